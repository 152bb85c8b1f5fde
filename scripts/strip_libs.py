"""Strip the symbol tables of a virtual environment's shared libraries, keeping only what still loads.

``strip --strip-unneeded`` (what Debian does to its packages) drops the static symbol table and debug
sections; the dynamic symbols that loading and linking need stay. In the lean SuperNode image this saves
~130 MB (``libtorch_cpu.so`` alone 89 MB, uvloop 12, ``libtorch_python.so`` 9). Some wheels' libraries were
rewritten by patchelf (auditwheel's vendored ``*.libs``: numpy's OpenBLAS) and binutils' strip makes them
unloadable ("ELF load command address/offset not page-aligned"). So every file is checked: stripped in
place, then loaded with ``ctypes.CDLL`` in a fresh, isolated process of the venv's Python; a file that
then fails to load (for whatever reason) gets its original back, as does one that strip cannot read or
does not shrink.

Usage (build stage, needs binutils' ``strip``): ``VENV/bin/python scripts/strip_libs.py VENV``; prints one
summary line (files and bytes stripped, files kept). Exit status 1 when ``strip`` is missing.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

LOAD = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"


def _loads(path: pathlib.Path) -> bool:
    """Whether the library at ``path`` loads (``dlopen``) in a fresh process of this Python."""
    res = subprocess.run([sys.executable, "-I", "-c", LOAD, str(path)], capture_output=True, check=False)
    return res.returncode == 0


def strip_tree(root: pathlib.Path) -> tuple[int, int, list[str]]:
    """Strip every ELF ``*.so*`` under ``root`` that still loads afterwards.

    Returns (files stripped, bytes saved, paths kept as they were). Raises FileNotFoundError when
    ``strip`` is not on PATH.
    """
    strip = shutil.which("strip")
    if strip is None:
        raise FileNotFoundError("strip (binutils) is not on PATH")
    n, saved, kept = 0, 0, []
    for path in sorted(p for p in root.rglob("*.so*") if p.is_file() and not p.is_symlink()):
        with open(path, "rb") as fh:
            if fh.read(4) != b"\x7fELF":
                continue
        backup = path.with_name(path.name + ".unstripped")
        shutil.copy2(path, backup)
        before = path.stat().st_size
        ok = subprocess.run([strip, "--strip-unneeded", str(path)], capture_output=True, check=False).returncode == 0
        if ok and path.stat().st_size < before and _loads(path):
            n, saved = n + 1, saved + before - path.stat().st_size
            backup.unlink()
        else:
            os.replace(backup, path)
            kept.append(str(path.relative_to(root)))
    return n, saved, kept


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        n, saved, kept = strip_tree(pathlib.Path(argv[1]))
    except FileNotFoundError as exc:
        print(f"strip_libs: {exc}", file=sys.stderr)
        return 1
    print(f"strip_libs: {n} libraries stripped, {saved / 1e6:.1f} MB saved; kept as they were: {', '.join(kept) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
