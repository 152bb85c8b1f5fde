"""MkDocs hook: the parts of the site generated at build time, so that they cannot drift.

* ``<!-- run-config-reference -->``: one table per group of run-config keys, rendered by
  :func:`fedcomp.app.keys.reference_table` from the keys' one declaration (:data:`GROUPS`).
* ``<!-- codec-reference -->``: an API entry per codec class the registry discovered
  (:data:`fedcomp.compression.CODECS`), in name order, so a new codec file appears by itself.
* ``<!-- include: PATH -->``: the text of a file of the repository (the changelog).
* ``<!-- results: NAME.json[, ...] -->``: the benchmark result files a page's tables come from, each
  with the date of the commit that last changed it (``git log``; "uncommitted" outside git).
* ``<!-- table: NAME.json -->``: the table a benchmark wrote into its result file (``"table"``:
  ``{"columns": [...], "rows": [[...], ...]}``, cells formatted by the benchmark), with the command that
  made it, so a page's figures are the file's.
"""

from __future__ import annotations

import functools
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the docs build from a checkout without an editable install too
    sys.path.insert(0, str(REPO))

RUN_CONFIG = re.compile(r"^<!-- run-config-reference -->$", re.M)
CODEC_REF = re.compile(r"^<!-- codec-reference -->$", re.M)
INCLUDE = re.compile(r"^<!-- include: (?P<path>[\w./-]+) -->$", re.M)
RESULTS = re.compile(r"^<!-- results: (?P<names>[\w., -]+) -->$", re.M)
TABLE = re.compile(r"^<!-- table: (?P<name>[\w.-]+\.json) -->$", re.M)

#: headings of the run-config groups (fedcomp.app.keys.GROUPS' names)
GROUP_TITLES = {"app": "Federation, strategy, training, data and results", "codec": "Codec and compression policy",
                "dp": "Differential privacy", "lora": "LoRA fine-tuning", "secagg": "Secure aggregation (SecAgg+)"}


@functools.cache
def run_config_reference() -> str:
    """Markdown: a heading and a key table per group, every declared key once."""
    from fedcomp.app.keys import GROUPS, reference_table

    missing = set(GROUPS) - set(GROUP_TITLES)
    if missing:
        raise ValueError(f"docs/hooks/generate.py: no heading for run-config group(s) {sorted(missing)}")
    parts = []
    for name, keys in GROUPS.items():
        parts.append(f"## {GROUP_TITLES[name]}\n\n{reference_table(keys)}\n")
    return "\n".join(parts)


def codec_reference() -> str:
    """Markdown: a mkdocstrings entry (``::: module.Class``) per registered codec."""
    from fedcomp.compression import CODECS

    return "\n\n".join(f"::: {cls.__module__}.{cls.__qualname__}\n    options:\n      heading_level: 4\n"
                        f"      members: false\n" for _, cls in sorted(CODECS.items()))


def _commit_date(path: pathlib.Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%cs", "--", str(path)],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "date unknown (no git)"
    return out.stdout.strip() or "uncommitted"


def results_line(names: str) -> str:
    """``Results: `benchmarks/results/x.json` (committed 2026-11-29)`` for each named file."""
    items = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        path = REPO / "benchmarks" / "results" / name
        if not path.is_file():
            raise ValueError(f"benchmark page names benchmarks/results/{name}, which does not exist")
        items.append(f"`benchmarks/results/{name}` (committed {_commit_date(path)})")
    return "!!! info \"Source\"\n    Result files: " + ", ".join(items) + "."


def results_table(name: str) -> str:
    """Markdown: the ``"table"`` of ``benchmarks/results/NAME``, then the command and the file's date."""
    import json

    path = REPO / "benchmarks" / "results" / name
    if not path.is_file():
        raise ValueError(f"benchmark page names benchmarks/results/{name}, which does not exist")
    data = json.loads(path.read_text())
    if "table" not in data:
        raise ValueError(f"benchmarks/results/{name} holds no 'table' for the page to show")
    cols, rows = data["table"]["columns"], data["table"]["rows"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    command = data.get("command", "")
    source = f"result file `benchmarks/results/{name}` (committed {_commit_date(path)})."
    return "\n".join(lines) + "\n\n" + (f"Made by `{command}`; {source}" if command else source.capitalize())


def on_page_markdown(markdown: str, page, config, files) -> str:  # MkDocs' hook signature
    """Replace the markers described in the module docstring."""
    markdown = RUN_CONFIG.sub(lambda m: run_config_reference(), markdown)
    markdown = CODEC_REF.sub(lambda m: codec_reference(), markdown)
    markdown = INCLUDE.sub(lambda m: (REPO / m.group("path")).read_text(), markdown)
    markdown = TABLE.sub(lambda m: results_table(m.group("name")), markdown)
    return RESULTS.sub(lambda m: results_line(m.group("names")), markdown)
