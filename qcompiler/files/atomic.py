"""Writes that either complete or leave nothing behind, and never delete what qcompiler did not write.

Output folders follow ``save_pretrained``'s convention, made safe:

- a folder is written in a temporary sibling ``.NAME.qc-PID-XXXX.tmp`` and published by one atomic
  ``renameat2(RENAME_EXCHANGE)`` with the target (Linux; elsewhere two renames), so a reader sees
  either the old or the new output, and a crash at any point leaves one of them in place;
- the folder's ``.qcompiler-output.json`` marker names its kind and every entry qcompiler wrote;
- an existing target is replaced only when it is empty or holds nothing but an earlier qcompiler
  output: of the same kind, or of another kind with ``overwrite=True``. A folder holding anything
  qcompiler did not write (a model, a file a user added to an earlier output) is never replaced,
  whatever ``overwrite`` says: the refusal names those files;
- ``/`` and its direct children, the system folders (``/etc``, ``/usr``, ...), the home and current
  folders and their ancestors, and the caller's protected paths (the input model's folder) are
  never written, whatever ``overwrite`` says;
- a single-file output (``check_output_file``) replaces only a file its writer recognizes as its own,
  and never lands inside a protected folder, a system folder or another qcompiler output;
- temporary siblings left by a killed writer (its PID no longer runs) are removed on the next write.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

from qcompiler.errors import QCompilerError
from qcompiler.files.regular_files import read_regular_file

__all__ = [
    "write_text_atomically",
    "atomic_file",
    "publish_directory",
    "check_output_folder",
    "check_output_file",
    "check_file_location",
    "temporary_sibling",
    "OutputPathError",
    "MARKER",
    "output_kind",
    "left_by_dead_processes",
    "naming_output",
]

MARKER = ".qcompiler-output.json"
_MARKER_MAX_BYTES = 1 << 20
# Folders an operating system owns: no qcompiler output belongs inside them (/var/tmp excepted).
_SYSTEM_FOLDERS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run")
_SYSTEM_FOLDERS += ("/sbin", "/sys", "/usr", "/var")
_SYSTEM_EXCEPTIONS = ("/var/tmp",)


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


_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")  # how Rust's I/O errors (safetensors') end
_SHORT_WRITE = re.compile(r"^\d+ requested and \d+ written$")  # numpy's tofile on a full disk


@contextlib.contextmanager
def naming_output(path, temporary=None) -> Iterator[None]:
    """A failed write that does not say where, or not as an OS error, becomes an ``OSError`` naming
    the output being written, so the one-line error says where the disk filled up: safetensors
    raises ``SafetensorError("... I/O error: No space left on device (os error 28)")``, numpy's
    ``tofile`` ``OSError("N requested and M written")`` with no errno, others ENOSPC without a name.
    An error naming a file inside ``temporary`` (the hidden folder an output is written in) names
    the output instead: that folder is gone once the error is printed."""
    try:
        yield
    except OSError as e:
        inside = temporary is not None and e.filename and _inside(Path(e.filename), temporary)
        if e.filename and not inside:
            raise
        if e.errno is None and _SHORT_WRITE.match(str(e)):
            raise OSError(
                errno.EIO, "short write (the disk is full or a file size limit was reached)", str(path)
            ) from e
        if e.errno is None:
            raise
        raise OSError(e.errno, e.strerror or os.strerror(e.errno), str(path)) from e
    except Exception as e:
        code = _OS_ERROR_CODE.search(str(e)) if type(e).__name__ == "SafetensorError" else None
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from e


@contextlib.contextmanager
def atomic_file(path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on failure it is removed."""
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{path} is a folder; give a file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path, folder=False, suffix=suffix + ".tmp")
    try:
        with naming_output(path):
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


def _read_marker(folder: Path) -> dict | None:
    """The marker of folder ``folder`` (a regular file, read without following links, size-bounded)."""
    try:
        data = json.loads(read_regular_file(folder / MARKER, _MARKER_MAX_BYTES))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("kind"), str) else None


def output_kind(path) -> str | None:
    """The kind recorded by qcompiler's marker in folder ``path``, or None (not a qcompiler output)."""
    marker = _read_marker(Path(path))
    return marker["kind"] if marker else None


def _entries(folder: Path) -> Iterator[str]:
    """Every entry under ``folder`` (files, links, folders; links not followed), as relative paths."""
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder)
        for name in dirs + files:
            yield (rel / name).as_posix()


def _foreign_entries(folder: Path, marker: dict | None, limit: int = 4) -> list[str]:
    """Up to ``limit`` entries of ``folder`` that qcompiler did not write (per its marker's list).

    A marker without a list of files (an old one, or a hand-made one) owns nothing but itself."""
    if marker is None:
        return sorted(p.name for p in folder.iterdir())[:limit]
    listed = marker.get("files")
    ours = {*(n for n in listed if isinstance(n, str)), MARKER} if isinstance(listed, list) else {MARKER}
    foreign = []
    for entry in _entries(folder):
        if entry not in ours:
            foreign.append(entry)
            if len(foreign) == limit:
                break
    return sorted(foreign)


def _inside(target: Path, folder: str | Path) -> bool:
    folder = Path(folder)
    return target == folder or folder in target.parents


def _system_folder(target: Path) -> str | None:
    if any(Path(e) in target.parents for e in _SYSTEM_EXCEPTIONS):  # inside /var/tmp, never /var/tmp itself
        return None
    return next((f for f in _SYSTEM_FOLDERS if _inside(target, f)), None)


def _inside_an_output(target: Path) -> str | None:
    """Whether ``target`` lies in a qcompiler output, whose next write would find it foreign."""
    for folder in target.parents:
        marker = _read_marker(folder)
        if marker:
            return f"it lies in the qcompiler {marker['kind']} output {folder}"
    return None


def _under_a_file(path: Path) -> str | None:
    """Why nothing can be written at ``path`` because one of its parents is a file, or None."""
    for parent in path.absolute().parents:
        if parent.exists() or parent.is_symlink():
            return None if parent.is_dir() else f"it lies under {parent}, which is a file"
    return None


def _never_replaced(target: Path, protect: Iterable) -> str | None:
    """Why folder ``target`` may never be replaced, or None."""
    home = Path.home().resolve()
    cwd = Path.cwd().resolve()
    if len(target.parts) <= 2:
        return "it is the file-system root or a folder directly under it"
    system = _system_folder(target)
    if system:
        return f"it lies in the system folder {system}"
    if _inside(home, target):
        return "it is your home folder or one of its parents"
    if _inside(cwd, target):
        return "it is the current folder or one of its parents"
    for p in protect:
        p = Path(p).resolve()
        if _inside(p, target):
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
    why = _under_a_file(path) or _never_replaced(target, protect) or _inside_an_output(target)
    if why:
        raise OutputPathError(f"refusing to write to {path}: {why}")
    if not path.exists():
        return path
    if not path.is_dir():
        raise OutputPathError(f"refusing to replace {path}: it is a file, and this output is a folder")
    marker = _read_marker(path)
    try:
        foreign = _foreign_entries(path, marker)
    except OSError as e:
        raise OutputPathError(f"cannot read {path}: {e.strerror}") from None
    if foreign:
        listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise OutputPathError(
            f"refusing to replace {path}: it holds files qcompiler did not write ({listed}); "
            "move them away or choose another folder"
        )
    if marker is None or marker["kind"] == kind or overwrite:
        return path
    raise OutputPathError(
        f"refusing to replace {path}: it holds a qcompiler {marker['kind']} output; "
        "choose another folder or pass --overwrite / overwrite=True"
    )


def check_output_file(path, kind: str, *, ours: Callable[[Path], bool], protect: Iterable = ()) -> Path:
    """Refuse (OutputPathError, one line) unless writing the ``kind`` file ``path`` loses nothing:
    it may replace only a regular file that ``ours`` recognizes as an earlier output of its writer,
    and never lands in a protected folder, a system folder or a qcompiler output folder."""
    path = check_file_location(path, kind, protect=protect)
    if path.exists() and not (path.is_file() and ours(path)):
        raise OutputPathError(
            f"refusing to replace {path}: qcompiler's {kind} writer did not write it; choose another name"
        )
    return path


def check_file_location(path, kind: str, *, protect: Iterable = ()) -> Path:
    """``check_output_file`` without the look at an existing file (its writer makes that one)."""
    path = Path(path)
    if path.is_symlink():
        raise OutputPathError(f"refusing to replace {path}: it is a symbolic link")
    if path.is_dir():
        raise OutputPathError(f"refusing to write the {kind} file {path}: it is a folder; give a file name")
    why = _under_a_file(path)
    if why:
        raise OutputPathError(f"refusing to write {path}: {why}")
    target = path.resolve()
    system = _system_folder(target)
    if system:
        raise OutputPathError(f"refusing to write {path}: it lies in the system folder {system}")
    for p in protect:
        p = Path(p).resolve()
        if _inside(target, p):
            raise OutputPathError(f"refusing to write {path}: it lies in the input {p}")
    why = _inside_an_output(target)
    if why:
        raise OutputPathError(f"refusing to write {path}: {why}")
    return path


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


def left_by_dead_processes(parent: Path, prefix: str) -> Iterator[Path]:
    """The entries of ``parent`` named ``prefix`` + PID + ``-...`` (how qcompiler names its
    temporaries) whose PID no longer runs: a killed process's leftovers; never a symbolic link."""
    for entry in parent.glob(f"{glob.escape(prefix)}*"):
        pid, dash, _ = entry.name[len(prefix) :].partition("-")
        if dash and pid.isdigit() and not _pid_alive(int(pid)) and not entry.is_symlink():
            yield entry


def _clean_stale(parent: Path, name: str) -> None:
    """Remove temporary siblings (files or folders) that a killed writer (PID gone) left behind; an
    output set aside by the two-rename fallback is put back first if the target is missing."""
    for entry in left_by_dead_processes(parent, f".{name}.qc-"):
        if entry.is_file():
            entry.unlink(missing_ok=True)
            continue
        if entry.name.endswith(".old") and (entry / "previous").is_dir() and not (parent / name).exists():
            os.rename(entry / "previous", parent / name)
        shutil.rmtree(entry, ignore_errors=True)


def temporary_sibling(path, *, folder: bool, suffix: str = ".tmp") -> Path:
    """A new private temporary file or folder beside ``path``, named so that the next write of
    ``path`` removes it if this process dies first (stale ones are removed now)."""
    path = Path(path)
    _clean_stale(path.parent, path.name)
    prefix = f".{path.name}.qc-{os.getpid()}-"
    if folder:
        return Path(tempfile.mkdtemp(dir=path.parent, prefix=prefix, suffix=suffix))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=suffix)
    os.close(fd)
    return Path(tmp)


@contextlib.contextmanager
def publish_directory(path, kind: str, *, overwrite: bool = False, protect: Iterable = ()) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes ``path`` in one atomic step (see the module doc).

    On failure (an exception, Ctrl-C) the temporary folder is removed and ``path`` is untouched.
    """
    path = Path(path)
    protect = tuple(protect)
    check_output_folder(path, kind, overwrite=overwrite, protect=protect)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path, folder=True)
    try:
        with naming_output(path, temporary=tmp):
            yield tmp
        written = sorted(_entries(tmp))
        (tmp / MARKER).write_text(json.dumps({"kind": kind, "files": written}) + "\n")  # last: marks it complete
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
