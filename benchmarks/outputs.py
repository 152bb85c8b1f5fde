"""Where a benchmark writes its JSON (and figure), so that quick modes leave the references alone.

A full run writes the committed reference ``benchmarks/results/<name>.json`` (the numbers the
docs/benchmarks pages quote). A quick/smoke run writes ``<temp dir>/fedcomp-benchmarks/<name>-quick.json``
instead, unless ``--out`` names a file: pass ``--out benchmarks/results/<name>.json`` to update a
reference on purpose.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]


def output_path(name: str, out: str | None, quick: bool) -> pathlib.Path:
    """The JSON file a run of benchmark ``name`` writes.

    Parameters
    ----------
    name : str
        Benchmark name, e.g. ``"privacy"`` (reference file ``benchmarks/results/privacy.json``).
    out : str or None
        ``--out`` as given on the command line; wins when set.
    quick : bool
        A quick/smoke run: goes to the temporary folder, never over a reference.
    """
    if out:
        return pathlib.Path(out)
    if quick:
        return pathlib.Path(tempfile.gettempdir()) / "fedcomp-benchmarks" / f"{name}-quick.json"
    return RESULTS / f"{name}.json"


def shown(path: pathlib.Path) -> str:
    """``path`` for a ``wrote ...`` line: relative to the repository when inside it (no machine paths
    in output that lands in the docs), else as given."""
    p = pathlib.Path(path).resolve()
    try:
        return str(p.relative_to(REPO))
    except ValueError:
        return os.fspath(path)
