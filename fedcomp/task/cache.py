"""The data cache folder: ``$FEDCOMP_DATA_DIR``, default ``~/.cache/fedcomp``.

What lives there is derived or fetched, never committed: the Shakespeare play texts
(`fedcomp.task.text_data`), a locally built LoRA base (``docs/how-to/lora.md``) and the digits
partitions a SuperNode computed once (`fedcomp.task.datafiles.cached_partition`).
"""

from __future__ import annotations

import os
import pathlib

#: Environment variable naming the data cache directory.
CACHE_ENV = "FEDCOMP_DATA_DIR"


def cache_dir() -> pathlib.Path:
    """``$FEDCOMP_DATA_DIR`` or ``~/.cache/fedcomp`` (not created here).

    Raises
    ------
    RuntimeError
        ``$FEDCOMP_DATA_DIR`` names something that exists and is not a directory (one line naming
        the variable).
    """
    out = pathlib.Path(os.environ.get(CACHE_ENV) or pathlib.Path.home() / ".cache" / "fedcomp")
    if out.exists() and not out.is_dir():
        raise RuntimeError(f"{CACHE_ENV} = {str(out)!r} is not a directory: point {CACHE_ENV} at a directory "
                           "for the data cache")
    return out
