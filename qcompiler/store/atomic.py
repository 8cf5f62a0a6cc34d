"""Writes that either complete or leave nothing behind, and never delete what qcompiler did not write.

Output folders follow ``save_pretrained``'s convention, made safe:

- a folder is written in a temporary sibling ``.NAME.qc-PID-XXXX.tmp`` and published by one atomic
  ``renameat2(RENAME_EXCHANGE)`` with the target (Linux; elsewhere two renames), so a reader sees
  either the old or the new output, and a crash at any point leaves one of them in place;
- an existing target is replaced only when it is empty or holds an earlier qcompiler output of the
  same kind (its ``.qcompiler-output.json`` marker says so); anything else needs ``overwrite=True``;
- ``/``, the home folder, the current folder and its ancestors, and the caller's protected paths
  (the input model's folder) are never replaced, whatever ``overwrite`` says;
- temporary siblings left by a killed writer (its PID no longer runs) are removed on the next write.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from qcompiler.errors import QCompilerError

__all__ = ["write_text_atomically", "atomic_file", "publish_directory", "OutputPathError", "MARKER", "output_kind"]

MARKER = ".qcompiler-output.json"


class OutputPathError(QCompilerError, ValueError):
    """An output path that qcompiler refuses to write (it would delete files it did not write)."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _publishable(path: Path) -> None:
    """mkstemp/mkdtemp create private (0600/0700) entries; give the result the usual permissions."""
    mask = _umask()
    if path.is_dir():
        os.chmod(path, 0o777 & ~mask)
        for child in path.rglob("*"):
            os.chmod(child, (0o777 if child.is_dir() else 0o666) & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)


@contextlib.contextmanager
def atomic_file(path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on failure it is removed."""
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{path} is a folder; give a file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix + ".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        _publishable(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomically(path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (no half-written file)."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def output_kind(path) -> str | None:
    """The kind recorded by qcompiler's marker in folder ``path``, or None (not a qcompiler output)."""
    try:
        data = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data.get("kind") if isinstance(data, dict) and isinstance(data.get("kind"), str) else None


def _never_replaced(target: Path, protect: Iterable) -> str | None:
    """Why ``target`` may never be replaced, or None."""
    home = Path.home().resolve()
    cwd = Path.cwd().resolve()
    if target == Path(target.anchor):
        return "it is the file-system root"
    if target == home:
        return "it is your home folder"
    if cwd == target or target in cwd.parents:
        return "it is the current folder or one of its parents"
    for p in protect:
        p = Path(p).resolve()
        if p == target or target in p.parents:
            return f"it holds the input {p}"
    return None


def check_output_folder(path, kind: str, *, overwrite: bool = False, protect: Iterable = ()) -> Path:
    """Refuse (OutputPathError, one line) unless writing a ``kind`` output at ``path`` loses nothing."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        raise OutputPathError(f"refusing to write into {str(path)!r}: name a new or qcompiler-made folder")
    if path.is_symlink():
        raise OutputPathError(f"refusing to replace {path}: it is a symbolic link")
    target = path.resolve()
    why = _never_replaced(target, protect)
    if why:
        raise OutputPathError(f"refusing to write to {path}: {why}")
    if not path.exists():
        return path
    if not path.is_dir():
        raise OutputPathError(f"refusing to replace {path}: it is a file, and this output is a folder")
    existing = output_kind(path)
    if existing == kind or overwrite:
        return path
    try:
        entries = sorted(p.name for p in path.iterdir())
    except OSError as e:
        raise OutputPathError(f"cannot read {path}: {e.strerror}") from None
    if not entries:
        return path
    listed = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    what = f"a qcompiler {existing} output" if existing else f"files qcompiler did not write ({listed})"
    raise OutputPathError(
        f"refusing to replace {path}: it holds {what}; choose another folder or pass --overwrite / overwrite=True"
    )


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(parent: Path, name: str) -> None:
    """Remove temporary siblings that a killed writer (PID gone) left behind; an output set aside
    by the two-rename fallback is put back first if the target is missing."""
    prefix = f".{name}.qc-"
    for entry in parent.glob(f"{glob.escape(prefix)}*"):
        pid = entry.name[len(prefix) :].split("-", 1)[0]
        if not (pid.isdigit() and not _pid_alive(int(pid)) and entry.is_dir() and not entry.is_symlink()):
            continue
        if entry.name.endswith(".old") and (entry / "previous").is_dir() and not (parent / name).exists():
            os.rename(entry / "previous", parent / name)
        shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def publish_directory(path, kind: str, *, overwrite: bool = False, protect: Iterable = ()) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes ``path`` in one atomic step (see the module doc).

    On failure (an exception, Ctrl-C) the temporary folder is removed and ``path`` is untouched.
    """
    path = Path(path)
    protect = tuple(protect)
    check_output_folder(path, kind, overwrite=overwrite, protect=protect)
    path.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(path.parent, path.name)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.qc-{os.getpid()}-", suffix=".tmp"))
    try:
        yield tmp
        (tmp / MARKER).write_text(json.dumps({"kind": kind}) + "\n")  # last: marks a complete output
        _publishable(tmp)
        check_output_folder(path, kind, overwrite=overwrite, protect=protect)  # again, just before the swap
        if not path.exists():
            try:
                os.rename(tmp, path)
                return
            except OSError as e:  # another writer published meanwhile: swap with theirs instead
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        if _exchange(tmp, path):
            shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous output
        else:  # no atomic exchange here: two renames; a crash between them leaves the old at `aside`
            aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.qc-{os.getpid()}-", suffix=".old"))
            os.rename(path, aside / "previous")
            os.rename(tmp, path)
            shutil.rmtree(aside, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
