"""Hugging Face hub ids (``google/gemma-3-270m``, ``org/name@revision``) as model sources: what users
type first. ``huggingface_hub`` fetches into its own cache (progress bar, resumable, the user's token
and ``HF_HUB_OFFLINE`` / ``HF_HUB_CACHE`` honoured); only what qcompiler reads is fetched — configs,
safetensors weights and tokenizer files, never pickle checkpoints, and model code only when the user
trusts it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

__all__ = ["HUB_ID", "hub_folder", "is_hub_id"]

# org/name with an optional @revision (a branch, tag or commit); no path can look like this and exist
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")
_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
_CODE = ["*.py"]


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a hub id and is not a local path."""
    return bool(HUB_ID.match(name)) and not Path(name).expanduser().exists()


def hub_folder(name: str, *, trust_remote_code: bool = False) -> Optional[Path]:
    """The local snapshot folder of hub id ``name`` (downloaded or found in the cache); None when
    ``name`` is not a hub id. Errors are one line naming the id."""
    if not is_hub_id(name):
        return None
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    match = HUB_ID.match(name)
    try:
        folder = snapshot_download(
            match["repo"],
            revision=match["revision"],
            allow_patterns=_FILES + (_CODE if trust_remote_code else []),
        )
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model {name} is not a local folder and is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); the hub could not be asked (offline: HF_HUB_OFFLINE, or no network)"
        ) from None
    except GatedRepoError:
        raise FileNotFoundError(
            f"model {name} is gated on the Hugging Face hub: accept its terms there and log in (hf auth login)"
        ) from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"model {name}: the hub has no revision {match['revision']!r} of it") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"model {name} is neither a local folder nor a model on the Hugging Face hub "
            "(a private one needs a login: hf auth login)"
        ) from None
    except HfHubHTTPError as e:
        raise OSError(f"model {name}: the Hugging Face hub answered {e}") from None
    return Path(folder)
