"""The README, the get-started page and the how-to guides work as pasted.

* Every ```python block of a page runs, in page order, in one fresh interpreter per page (a block
  may use names defined by an earlier one of the same page; lines meant for a user's own app belong
  in ```diff blocks).
* Every ```bash block is valid shell (`bash -n`); the cheap ones, marked by a
  ``<!-- readme-test: run -->`` line right before the fence, are executed in a scratch project
  folder (with ``scripts/`` of this repository, a private ``HOME``, ``FLWR_HOME`` and ports), must
  exit 0 and must leave nothing in the project folder that ``.gitignore`` does not ignore (generated
  models and data go to the cache folder). Long runs (a whole
  federation, the test suite) are left unmarked.
* Every ```toml block parses.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pathspec  # Flower's own dependency (its bundle rules)
import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = pathlib.Path(__file__).resolve().parents[1]
RUN_MARK = "<!-- readme-test: run -->"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.DOTALL | re.MULTILINE)
#: the pages whose code blocks a reader pastes
PAGES = [REPO / "README.md", REPO / "docs" / "get-started.md", *sorted((REPO / "docs" / "how-to").glob("*.md"))]


def readme_blocks(text: str) -> list[tuple[str, str, int, bool]]:
    """``(language, code, first line number, marked to run)`` of every fenced block, in order;
    indented fences (inside list items) are dedented."""
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip().rsplit("\n", 1)[-1].strip()
        out.append((m.group("lang"), textwrap.dedent(m.group("body")), line + 1, before == RUN_MARK))
    return out


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(REPO))


BLOCKS = {_name(p): readme_blocks(p.read_text()) for p in PAGES}
ALL = [(page, *b) for page, blocks in BLOCKS.items() for b in blocks]

_RUNNER = """
import sys, traceback
blocks = {blocks!r}
ns = {{"__name__": "__main__"}}
for line, code in blocks:
    try:
        exec(compile(code, f"{page}, block at line {{line}}", "exec"), ns)
    except BaseException:
        traceback.print_exc()
        print(f"{page} python block starting at line {{line}} failed", file=sys.stderr)
        sys.exit(1)
"""


def _ids(v):
    return v if isinstance(v, str) and "\n" not in v and len(v) < 60 else (f"line{v}" if isinstance(v, int) else "")


def test_fences_are_found():
    """The extractor sees the pages' blocks (so the tests below cannot pass on nothing)."""
    langs = [b[1] for b in ALL]
    assert langs.count("python") >= 2 and langs.count("bash") >= 20 and "diff" in langs and "toml" in langs
    assert sum(run for *_, run in ALL) >= 4
    readme = [b[0] for b in BLOCKS["README.md"]]
    assert readme.count("python") >= 1 and readme.count("bash") >= 3 and "diff" in readme
    assert all(BLOCKS[_name(p)] for p in PAGES if p.name not in ("differential-privacy.md",))


@pytest.mark.parametrize("page", [p for p, blocks in BLOCKS.items() if any(b[0] == "python" for b in blocks)])
def test_python_blocks_run_in_order_in_one_fresh_interpreter(page, tmp_path):
    blocks = [(line, code) for lang, code, line, _ in BLOCKS[page] if lang == "python"]
    script = _RUNNER.format(blocks=blocks, page=page)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


@pytest.mark.parametrize("page,line,code",
                         [(p, line, code) for p, lang, code, line, _ in ALL if lang in ("bash", "sh")], ids=_ids)
def test_shell_blocks_parse(page, line, code):
    out = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
    assert out.returncode == 0, f"{page} line {line}: {out.stderr}"


@pytest.mark.parametrize("page,line,code", [(p, line, code) for p, _, code, line, run in ALL if run], ids=_ids)
def test_cheap_shell_blocks_run(page, line, code, tmp_path):
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    home.mkdir()
    (project / "scripts").symlink_to(REPO / "scripts")
    env = {**os.environ, "FLWR_HOME": str(home / "flwr-home"), "HOME": str(home),
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": "1", "FLWR_LOCAL_CONTROL_API_PORT": "2",
           "PYTHONPATH": str(REPO),
           "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("FEDCOMP_DATA_DIR", None)
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=project, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"{page} line {line}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    ignored = pathspec.PathSpec.from_lines("gitwildmatch", (REPO / ".gitignore").read_text().splitlines())
    left = sorted(p.name for p in project.iterdir()
                  if p.name != "scripts" and not ignored.match_file(p.name + ("/" if p.is_dir() else "")))
    assert left == [], f"{page} line {line} wrote {left} into the project folder"


@pytest.mark.parametrize("page,line,code", [(p, line, code) for p, lang, code, line, _ in ALL if lang == "toml"],
                         ids=_ids)
def test_toml_blocks_parse(page, line, code):
    tomllib.loads(code)


def test_the_pages_never_kill_by_name():
    """Stopping a SuperLink by name would stop other users' SuperLinks too: no command in the
    README or the docs does it (in a block or inline)."""
    for page in [*PAGES, *sorted((REPO / "docs").rglob("*.md"))]:
        text = page.read_text()
        code = [c for _, c, _, _ in readme_blocks(text)] + re.findall(r"`([^`\n]+)`", text)
        assert not [c for c in code if re.search(r"\b(pkill|killall)\b\s+-", c)], page


def test_the_readme_is_a_front_page():
    """The README is a front page of at most 250 lines; the manual lives in docs/."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_the_readme_links_resolve():
    """Every relative link of the README names a file of the repository (the docs pages it sends
    readers to)."""
    text = (REPO / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]
    assert targets and not [t for t in targets if t and not (REPO / t).exists()]


def test_no_load_figures_of_one_machine_in_the_docs():
    """Pages state the machine a figure was measured on, not its load at the time ("load ~17")."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    hits = [(str(p.relative_to(REPO)), m.group(0)) for p in pages
            for m in re.finditer(r"\bload(?: average)? ?~?\d", p.read_text())]
    assert hits == []
