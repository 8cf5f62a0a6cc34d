"""Opening a file that untrusted data names: the file itself, never what a link points at, never a
FIFO or device (a reader would block, or read ``/dev/zero`` forever), and never past a size bound."""

from __future__ import annotations

import hashlib
import os
import stat

__all__ = ["open_regular", "read_regular_file", "sha256_of", "file_kind"]


def open_regular(path, *, dir_fd: int | None = None):
    """``path`` open for reading in binary; OSError when it cannot be opened (a symbolic link
    included), ValueError when it is not a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=dir_fd)
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise ValueError(f"{path} is not a regular file")
    return f


def read_regular_file(path, limit: int, *, dir_fd: int | None = None) -> bytes:
    """The bytes of ``path`` (see :func:`open_regular`), at most ``limit`` of them, else
    ValueError naming it."""
    with open_regular(path, dir_fd=dir_fd) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise ValueError(f"{path} is {size} bytes, over the {limit}-byte bound")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} grew past the {limit}-byte bound while read")
    return data


def sha256_of(f, chunk: int = 1 << 24) -> str:
    """The SHA-256 hex digest of the rest of the open binary file ``f``, read in 16 MB chunks."""
    digest = hashlib.sha256()
    while block := f.read(chunk):
        digest.update(block)
    return digest.hexdigest()


def file_kind(path) -> str:
    """What a path that is not a regular file is, in words (links followed), for a one-line refusal."""
    mode = os.stat(path).st_mode
    for test, kind in (
        (stat.S_ISDIR, "folder"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return kind
    return "special file"
