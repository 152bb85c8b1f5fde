"""docs/tutorial.md works as a reader follows it.

* Its ```python blocks run in page order, in one namespace, in one fresh interpreter whose working
  folder is a copy of ``examples/existing-app`` (the app the tutorial edits: the reader starts Python
  in the app's folder), with fedcomp importable.
* A ```text block right after a python block is the output the page promises: the block's own
  standard output must read the same, line by line. Numbers must be equal, except a number followed by
  ``%`` (an accuracy), which may differ by up to 5 points (float rounding of another machine can move a
  test image or two).
* The byte counts the page shows for `flwr run` (its last ```text block) are those the in-process run
  printed, and the ```diff blocks add lines that the example app holds.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "tutorial.md"
EXAMPLE = REPO / "examples" / "existing-app"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.DOTALL | re.MULTILINE)
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?( ?%)?")
#: points an accuracy (a number followed by "%") may differ from the page's
PERCENT_TOLERANCE = 5.0

_RUNNER = """
import contextlib, io, json, sys, traceback
blocks = json.loads(sys.argv[1])
outputs = []
ns = {"__name__": "__main__"}
for line, code in blocks:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"docs/tutorial.md, block at line {line}", "exec"), ns)
    except BaseException:
        traceback.print_exc()
        print(f"docs/tutorial.md python block starting at line {line} failed", file=sys.stderr)
        sys.exit(1)
    outputs.append(out.getvalue())
print(json.dumps(outputs))
"""


def blocks(text: str) -> list[tuple[str, str, int]]:
    """``(language, code, first line number)`` of every fenced block of ``text``, in order."""
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 2
        out.append((m.group("lang"), textwrap.dedent(m.group("body")), line))
    return out


BLOCKS = blocks(PAGE.read_text())
PYTHON = [(i, code, line) for i, (lang, code, line) in enumerate(BLOCKS) if lang == "python"]


def expected_output(index: int) -> str | None:
    """The ```text block right after block ``index`` (None if the next block is not one)."""
    if index + 1 < len(BLOCKS) and BLOCKS[index + 1][0] == "text":
        return BLOCKS[index + 1][1]
    return None


def same_line(got: str, want: str) -> bool:
    """``got`` reads as ``want``: the same words, equal numbers, accuracies within the tolerance."""
    if NUMBER.sub("#", got).split() != NUMBER.sub("#", want).split():
        return False
    for g, w in zip(NUMBER.finditer(got), NUMBER.finditer(want)):
        gv, wv = (float(m.group(0).rstrip(" %").replace(",", "")) for m in (g, w))
        if w.group(1):  # an accuracy in %
            if abs(gv - wv) > PERCENT_TOLERANCE:
                return False
        elif g.group(0) != w.group(0):
            return False
    return True


def test_the_page_has_what_the_tests_read():
    langs = [lang for lang, _, _ in BLOCKS]
    assert len(PYTHON) >= 3 and langs.count("diff") >= 2 and "bash" in langs
    assert sum(expected_output(i) is not None for i, _, _ in PYTHON) >= 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The page's python blocks run in order in a copy of the example app: each block's stdout."""
    app = tmp_path_factory.mktemp("tutorial") / "existing-app"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__"))
    code = json.dumps([(line, code) for _, code, line in PYTHON])
    proc = subprocess.run([sys.executable, "-c", _RUNNER, code], cwd=app, capture_output=True, text=True,
                          timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_python_blocks_print_what_the_page_shows(run):
    assert len(run) == len(PYTHON)
    for (index, _, line), got in zip(PYTHON, run):
        want = expected_output(index)
        if want is None:
            continue
        got_lines, want_lines = got.strip("\n").splitlines(), want.strip("\n").splitlines()
        assert len(got_lines) == len(want_lines), f"block at line {line} printed:\n{got}"
        bad = [(g, w) for g, w in zip(got_lines, want_lines) if not same_line(g, w)]
        assert bad == [], f"block at line {line}: printed / page:\n" + "\n".join(f"{g}\n{w}" for g, w in bad)


def test_the_flwr_run_output_shows_the_bytes_of_the_in_process_run(run):
    table = next(out for out in run if out.split()[:3] == ["round", "up", "B"])
    rounds = [row.split() for row in table.strip().splitlines()[1:]]
    shown = BLOCKS[[i for i, (lang, _, _) in enumerate(BLOCKS) if lang == "text"][-1]][1]
    metrics = re.findall(r"\[ROUND (\d+)/\d+\].*?'upload-bytes': ([\d.]+), 'download-bytes': ([\d.]+)", shown,
                         re.DOTALL)
    assert metrics, shown
    for rnd, up, down in metrics:
        row = rounds[int(rnd) - 1]
        assert (float(up), float(down)) == (float(row[1]), float(row[2])), (rnd, row)


def test_the_diffs_add_lines_the_example_app_holds():
    code = "\n".join(f.read_text() for f in sorted((EXAMPLE / "existingapp").glob("*.py")))
    added = [ln[1:].split("#")[0].strip() for lang, body, _ in BLOCKS if lang == "diff"
             for ln in body.splitlines() if ln.startswith("+")]
    assert len(added) == 4 and all(a and a in code for a in added), added


@pytest.mark.parametrize("case,ok", [
    (("    1   812    5008     23.7x    24.4 %", "    1   812    5008     23.7x    24.4 %"), True),
    (("    1   812    5008     23.7x    26.1 %", "    1   812    5008     23.7x    24.4 %"), True),
    (("    1   812    5008     23.7x    34.4 %", "    1   812    5008     23.7x    24.4 %"), False),
    (("    1   813    5008     23.7x    24.4 %", "    1   812    5008     23.7x    24.4 %"), False),
    (("upload:   sign()+EF [tensor]", "upload:   stc()+EF [model]"), False),
])
def test_the_line_comparison(case, ok):
    assert same_line(*case) is ok
