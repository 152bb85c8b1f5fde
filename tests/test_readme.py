"""The README works as pasted.

* Every ```python block runs, in README order, in one fresh interpreter (a block may use names
  defined by an earlier one; lines meant for a user's own app belong in ```diff blocks).
* Every ```bash block is valid shell (`bash -n`); the cheap ones, marked by a
  ``<!-- readme-test: run -->`` line right before the fence, are executed in a scratch folder
  (with ``scripts/`` of this repository, a private ``FLWR_HOME`` and ports) and must exit 0.
* Every ```toml block parses.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = pathlib.Path(__file__).resolve().parents[1]
RUN_MARK = "<!-- readme-test: run -->"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.DOTALL | re.MULTILINE)


def readme_blocks(text: str) -> list[tuple[str, str, int, bool]]:
    """``(language, code, first line number, marked to run)`` of every fenced block, in order;
    indented fences (inside list items) are dedented."""
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip().rsplit("\n", 1)[-1].strip()
        out.append((m.group("lang"), textwrap.dedent(m.group("body")), line + 1, before == RUN_MARK))
    return out


BLOCKS = readme_blocks((REPO / "README.md").read_text())

_RUNNER = """
import sys, traceback
blocks = {blocks!r}
ns = {{"__name__": "__main__"}}
for line, code in blocks:
    try:
        exec(compile(code, f"README.md, block at line {{line}}", "exec"), ns)
    except BaseException:
        traceback.print_exc()
        print(f"README python block starting at line {{line}} failed", file=sys.stderr)
        sys.exit(1)
"""


def test_fences_are_found():
    """The extractor sees the README's blocks (so the tests below cannot pass on nothing)."""
    langs = [b[0] for b in BLOCKS]
    assert langs.count("python") >= 1 and langs.count("bash") >= 5 and "diff" in langs
    assert any(run for *_, run in BLOCKS)


def test_python_blocks_run_in_order_in_one_fresh_interpreter(tmp_path):
    blocks = [(line, code) for lang, code, line, _ in BLOCKS if lang == "python"]
    script = _RUNNER.format(blocks=blocks)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


@pytest.mark.parametrize("line,code", [(line, code) for lang, code, line, _ in BLOCKS if lang in ("bash", "sh")],
                         ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_shell_blocks_parse(line, code):
    out = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
    assert out.returncode == 0, f"README line {line}: {out.stderr}"


@pytest.mark.parametrize("line,code", [(line, code) for lang, code, line, run in BLOCKS if run],
                         ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_cheap_shell_blocks_run(line, code, tmp_path):
    (tmp_path / "scripts").symlink_to(REPO / "scripts")
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home"), "HOME": str(tmp_path),
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": "1", "FLWR_LOCAL_CONTROL_API_PORT": "2",
           "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"README line {line}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"


@pytest.mark.parametrize("line,code", [(line, code) for lang, code, line, _ in BLOCKS if lang == "toml"],
                         ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_toml_blocks_parse(line, code):
    tomllib.loads(code)


def test_readme_never_kills_by_name():
    """Stopping a SuperLink by name would stop other users' SuperLinks too: no command in the
    README does it (in a block or inline)."""
    text = (REPO / "README.md").read_text()
    code = [c for _, c, _, _ in BLOCKS] + re.findall(r"`([^`\n]+)`", text)
    assert not [c for c in code if re.search(r"\b(pkill|killall)\b\s+-", c)]
