"""Per-round results: the console table, ``metrics.json`` and ``plot.png`` (matplotlib)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import pathlib
from typing import Any

from fedcomp.util.files import write_atomically

MB = 1e6

COLUMNS = [("round", "{:>5}"), ("accuracy", "{:>8.4f}"), ("loss", "{:>7.4f}"), ("upload-mb", "{:>8.4f}"),
           ("download-mb", "{:>8.4f}"), ("cumulative-mb", "{:>9.3f}"), ("compression-ratio", "{:>8.1f}"),
           ("cumulative-ratio-both-ways", "{:>8.1f}")]
#: ``MB up`` / ``MB down``: this round's bytes each way; ``cum. MB``: the run's bytes both ways so far;
#: ``ratio up``: fp32 / uploaded bytes this round; ``both``: the run's fp32 bytes both ways / its bytes
#: both ways so far (first contacts and catch-ups included).
HEADER = (f"{'round':>5} {'accuracy':>8} {'loss':>7} {'MB up':>8} {'MB down':>8} {'cum. MB':>9} {'ratio up':>8} "
          f"{'both':>8}")
DP_HEADER = f" {'epsilon':>8} {'eps/rnd':>8}"


def format_row(rec: dict[str, Any], dp: bool = False) -> str:
    """One table line for a round record (missing values print as '-'; with ``dp`` the cumulative
    epsilon and this round's increase are appended, "inf" meaning no privacy)."""
    out = []
    if dp:
        eps = rec.get("epsilon", rec.get("epsilon-max"))
        step = rec.get("epsilon-round")
        tail = f" {'-' if eps is None else f'{eps:8.3f}':>8} {'-' if step is None else f'{step:8.3f}':>8}"
    else:
        tail = ""
    for key, fmt in COLUMNS:
        v = rec.get(key)
        width = int(fmt[3:].split(".")[0].rstrip("fd")) if v is None else 0
        out.append("-".rjust(width) if v is None else fmt.format(v))
    return " ".join(out) + tail


def default_results_dir(compressor: str) -> pathlib.Path:
    """``$FEDCOMP_RESULTS_ROOT`` or ``~/fedcomp-results``, then ``<UTC timestamp>-<compressor>``."""
    root = pathlib.Path(os.environ.get("FEDCOMP_RESULTS_ROOT", pathlib.Path.home() / "fedcomp-results"))
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%d-%H%M%S")
    return root / f"{stamp}-{compressor}"


def resolve_results_dir(results_dir: str, compressor: str) -> pathlib.Path:
    """Absolute results folder: ``results-dir`` if given (relative paths resolve against the
    ServerApp's working directory, which under ``flwr run`` is the local SuperLink's), else
    `default_results_dir`. Created if missing; ``<root>/latest`` points at it when the
    default is used."""
    if results_dir:
        path = pathlib.Path(results_dir).expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = default_results_dir(compressor).resolve()
    path.mkdir(parents=True, exist_ok=True)
    latest = path.parent / "latest"
    try:
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(path.name)
    except OSError:
        pass
    return path


def finite_or_none(obj: Any) -> Any:
    """Replace NaN/Inf floats by None so the file is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def write_json(path: pathlib.Path, payload: dict[str, Any]) -> None:
    """Write strict JSON (non-finite floats as null) atomically (`fedcomp.util.files.write_atomically`)."""
    write_atomically(path, json.dumps(finite_or_none(payload), indent=1, allow_nan=False).encode())


def plot_rounds(rounds: list[dict[str, Any]], path: pathlib.Path, title: str) -> bool:
    """``plot.png``: accuracy vs cumulative uploaded MB (log x) and accuracy vs round.

    Returns False (and logs a warning, no plot) where matplotlib, the ``plots`` extra, is not installed:
    a ServerApp on a core install still writes ``metrics.json``.
    """
    try:
        import matplotlib
    except ModuleNotFoundError:
        from logging import WARNING

        from flwr.common.logger import log

        from fedcomp.util.extras import install_hint

        log(WARNING, f"fedcomp  no plot.png: matplotlib is not installed ({install_hint('plots')})")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in rounds if r.get("accuracy") is not None]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    trained = [r for r in recs if r["round"] > 0 and r.get("cumulative-upload-mb", 0) > 0]
    a1.plot([r["cumulative-upload-mb"] for r in trained], [r["accuracy"] for r in trained], marker=".")
    a1.set_xscale("log")
    a1.set_xlabel("cumulative upload (MB, log scale)")
    a1.set_ylabel("test accuracy")
    a1.grid(True, alpha=0.3)
    a2.plot([r["round"] for r in recs], [r["accuracy"] for r in recs], marker=".")
    a2.set_xlabel("round")
    a2.set_ylabel("test accuracy")
    a2.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    try:
        write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
    return True
