"""Atomic, durable file writes for everything fedcomp keeps on disk (server results and
checkpoints, client residuals and privacy accountants).

One rule for all writers: write a temporary file in the target's folder, ``fsync`` it, rename it
over the target (``os.replace``: readers see the old file or the new one, never a torn one), then
``fsync`` the folder so that the rename itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
from typing import BinaryIO, Callable


def write_atomically(path: pathlib.Path, write: Callable[[BinaryIO], None] | bytes) -> None:
    """Replace ``path`` by new content, atomically and durably.

    Parameters
    ----------
    path : pathlib.Path
        The file to write; its folder must exist.
    write : bytes or callable
        The content, or a function that writes it into the binary file object it is given
        (``np.savez``, ``fig.savefig(f, format="png")``, ...).

    Raises
    ------
    OSError
        The folder is not writable or the disk is full; ``path`` is then left as it was and the
        temporary file is removed (one may remain only if the process dies mid-write).

    Each call writes its own temporary file (``.<name>.<pid>.<random>.tmp``), so writers of the same
    path in other processes or threads (two SuperNodes filling the same partition cache file) never
    share one: the last ``os.replace`` wins, and a reader sees one writer's whole file.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            if callable(write):
                write(f)
            else:
                f.write(write)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # pragma: no cover - folders cannot be opened on some platforms
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
