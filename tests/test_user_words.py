"""The documentation speaks to a user, not from the project's notebook.

A reader of the README, the docs pages or an API docstring needs what the code does now. Tracker
numbers, "(was ...)" notes, comparisons with an earlier state of the code and the load of the
machine a figure was measured on say nothing to them; the history of a change belongs in
CHANGELOG.md (and docs/changelog.md, generated from it), which this test does not read.

Checked: README.md, docs/**/*.md except the changelog page (prose only: fenced code blocks and
inline code are left out) and the docstrings of fedcomp/**/*.py (read with ``ast``). Files still
being rewritten are listed in the allow-lists below, each with what is left; the lists only
shrink. The code is read for one thing too: no .py file of the library, the tests, the
benchmarks, the examples, the scripts or the docs' hooks names an issue number, whether in a
comment, a docstring, a help text or a printed line (a link to another project's issue is a
citation and stays).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

#: (what it is, pattern); matched case-insensitively against prose with code removed
PHRASES = [
    ("an issue number", r"\bissues?\s*#?\d+"),
    ("an issue's target", r"\bissue's\b"),
    ("a tracker reference", r"(?<![\w&/#\]])#\d+\b"),
    ("a (was ...) history note", r"\(was\b|;\s+was\s+[\d.~<>]"),
    ("a comparison with earlier code",
     (r"\b(?:the|its) (?:default|code|defaults) before\b"
      r"|\bbefore (?:this|that|the|these) (?:change|changes|fix|pass|split|correction)\b"
      r"|\bbefore:\s|[;(.!?]\s*before,\s")),
    ("the load of the measuring machine",
     (r"\brunnable process|\bin this measurement\b|\bshared by ~?\d+"
      r"|\bload(?: average)? ?~?\d")),
    ("this project's machines", r"\bthis project's (?:\w+ )?(?:machines?|CI)\b|\bthis machine's\b"),
    ("a commit of this repository", r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
]
_COMPILED = [(what, re.compile(p, re.IGNORECASE)) for what, p in PHRASES]

#: Pages someone else is rewriting now; each names what is left. Remove an entry once it is clean.
PAGE_ALLOW: dict[str, str] = {}

#: Source files whose docstrings still carry notebook words (the code's owners rewrite them).
DOCSTRING_ALLOW: dict[str, str] = {}

#: Folders whose .py files name no issue number anywhere (comments and strings included).
CODE_DIRS = ["fedcomp", "tests", "benchmarks", "examples", "scripts", "docs/hooks"]
_ISSUE_NUMBER = re.compile(r"[Ii]ssue[s]? ?#?[0-9]{1,3}\b")
_URL = re.compile(r"https?://\S+")

_FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.DOTALL | re.MULTILINE)
_INLINE = re.compile(r"`[^`\n]*`")
_HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)


def prose(markdown: str) -> str:
    """The text a reader reads as sentences: code blocks and inline code blanked (line numbers kept)."""
    def blank(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    for pattern in (_FENCE, _HTML_COMMENT, _INLINE):
        markdown = pattern.sub(blank, markdown)
    return markdown


def violations(text: str) -> list[tuple[int, str, str]]:
    """``(line, what, matched text)`` for every notebook phrase in ``text``."""
    out = []
    for what, rx in _COMPILED:
        for m in rx.finditer(text):
            out.append((text.count("\n", 0, m.start()) + 1, what, m.group(0)))
    return sorted(out)


def issue_numbers(source: str) -> list[tuple[int, str]]:
    """``(line, matched text)`` for every issue number in ``source``; links are left out."""
    source = _URL.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), source)
    return [(source.count("\n", 0, m.start()) + 1, m.group(0)) for m in _ISSUE_NUMBER.finditer(source)]


def _pages() -> list[pathlib.Path]:
    docs = sorted(p for p in (REPO / "docs").rglob("*.md") if p.name != "changelog.md")
    return [REPO / "README.md", *docs]


def _docstrings(path: pathlib.Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = [tree, *(n for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    out = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=False)
        if doc:
            first = node.body[0].lineno if node.body else 1
            out.append((first, doc))
    return out


def _name(path: pathlib.Path) -> str:
    return path.relative_to(REPO).as_posix()


#: ``(text, hits)``: notebook phrases the patterns must find, and words they must leave alone.
SAMPLES = [
    ("fixed in (issue 34) and issue 31's target, the issue's demand", 3),
    ("as in #12, peaks at 1.6x (was 40x), 0.3 s; was 2 s", 3),
    ("| dense download (the default before) | the code before the fix | before this change |", 3),
    ("(before, it was refused) 45 s in this measurement, the 2 cores shared by ~20 runnable processes", 4),
    ("on this project's CI machine, this machine's base; the clean-clone `.ci/run` of 298d166", 3),
    ("2,234 passed at 1e100, a 0x1F header, 16,000,000 bytes, deadbeef", 0),
    ("see [the section](#secure-aggregation), `x #3` and\n```\nissue 5\n```\nare code", 0),
    ("before the first backward pass, the issues a user may hit, a 2 x 4 grid, what it reported before, and", 0),
    ("one name. Before, both travelled (sent once; before, twice); 2 s (before: 9 s)", 3),
]


@pytest.mark.parametrize("text,hits", SAMPLES)
def test_the_patterns_find_what_they_should(text, hits):
    assert len(violations(prose(text))) == hits, violations(prose(text))


@pytest.mark.parametrize("page", _pages(), ids=_name)
def test_pages_speak_to_a_user(page):
    name = _name(page)
    found = violations(prose(page.read_text()))
    if name in PAGE_ALLOW:
        if not found:
            pytest.fail(f"{name} is clean now: remove it from PAGE_ALLOW")
        pytest.xfail(PAGE_ALLOW[name])
    assert found == [], "\n".join(f"{name}:{line}: {what}: {text!r}" for line, what, text in found)


def test_docstrings_speak_to_a_user():
    bad, clean_but_allowed = [], []
    for path in sorted((REPO / "fedcomp").rglob("*.py")):
        name = _name(path)
        found = [(first + line - 1, what, text)
                 for first, doc in _docstrings(path) for line, what, text in violations(doc)]
        if name in DOCSTRING_ALLOW:
            if not found:
                clean_but_allowed.append(name)
            continue
        bad += [f"{name}:{line}: {what}: {text!r}" for line, what, text in found]
    assert bad == [], "\n".join(bad)
    assert clean_but_allowed == [], f"clean now, remove from DOCSTRING_ALLOW: {clean_but_allowed}"


#: ``(source, hits)``: issue numbers in code, and what is no issue number (a link, a word).
CODE_SAMPLES = [
    ("# one line per round (issue 24)\n\"\"\"Issue 30: the README\"\"\"\nhelp='(issues #12 and 14.1)'", 3),
    ("# torch's own bug: https://github.com/pytorch/pytorch/issues/12345, see Issue3 there", 1),
    ("the issues a user may hit, an issue-free run, issue 1000 rows, issue_7", 0),
]


@pytest.mark.parametrize("source,hits", CODE_SAMPLES)
def test_the_issue_number_pattern_finds_what_it_should(source, hits):
    assert len(issue_numbers(source)) == hits, issue_numbers(source)


def _code_source(path: pathlib.Path) -> str:
    """The file's text; for this file, with the samples (notebook words on purpose) blanked."""
    text = path.read_text()
    if path.resolve() != pathlib.Path(__file__).resolve():
        return text
    lines = text.splitlines(keepends=True)
    for node in ast.parse(text).body:
        names = [getattr(target, "id", None) for target in getattr(node, "targets", [])]
        if names in (["SAMPLES"], ["CODE_SAMPLES"]):
            lines[node.lineno - 1:node.end_lineno] = ["\n"] * (node.end_lineno - node.lineno + 1)
    return "".join(lines)


def test_the_code_names_no_issue_number():
    files = sorted(p for d in CODE_DIRS for p in (REPO / d).rglob("*.py")
                   if not any(part.startswith(".") for part in p.relative_to(REPO).parts))
    assert len(files) > 100
    bad = [f"{_name(p)}:{line}: {text!r}" for p in files for line, text in issue_numbers(_code_source(p))]
    assert bad == [], ("say what the thing is or why, not which issue asked for it (history belongs in "
                       "CHANGELOG.md):\n" + "\n".join(bad))


def test_the_allow_lists_name_files_that_exist():
    assert [n for n in [*PAGE_ALLOW, *DOCSTRING_ALLOW] if not (REPO / n).exists()] == []
