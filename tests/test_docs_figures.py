"""Every benchmark figure on the site is the one in its result file.

The benchmark pages (docs/benchmarks/*.md) hold no figures of their own: ``docs/hooks/generate.py``
renders each table (``<!-- table: ID -->``) and each figure in running text (``<!-- value: ... -->``)
from ``benchmarks/results/*.json`` when the site is built, with the command that made the file and
the date of its last commit. These tests render the pages through the hook (no browser, no
``mkdocs``) and check

* that every marker renders, and every table under it names its result file, its commit date and
  the command that made it;
* that every rendered figure equals its JSON: each figure's text, read back as a number, is the
  value the hook took from the file, to the precision shown; a few rows are also recomputed here
  from the JSON directly, without the hook's expressions;
* that a benchmark page holds no hand-typed table: every table in its source is a rendered one or
  says, in a ``<!-- not from a result file: ... -->`` line above it, that its figures come from no
  benchmark; no code block holds pasted benchmark output; and running text holds no hand-typed
  measured percentage or ratio (a decimal followed by ``%`` or ``x``), outside the pages listed in
  :data:`PROSE_ALLOW`;
* that a changed result file changes the page (the figures cannot go stale).

The other pages (get-started, the tutorial, the FAQ, how-tos, explanations, reference: every page
of ``docs/`` outside ``docs/benchmarks/``) quote benchmark figures too, with the same value markers:
every marker renders and equals its JSON, and their text, tables included, holds no hand-typed
decimal percentage or ratio but those of :data:`NOT_BENCHMARK_FIGURES`. The README, which MkDocs does
not render, keeps typed figures; :data:`README_FIGURES` holds each against its JSON. The result files
themselves name no machine path, and each command they record is one a user types from the
repository root.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import pathlib
import re
import shutil
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = sorted((DOCS / "benchmarks").glob("*.md"))
#: every other page of the site (the tutorial, the FAQ, how-tos, explanations, reference)
OTHER_PAGES = sorted(p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).parts[0] != "benchmarks")
RESULT_FILES = sorted((REPO / "benchmarks" / "results").glob("*.json"))

#: Figures that the running text of a page outside docs/benchmarks/ may type although they are a decimal
#: percentage or ratio, because they are not benchmark results: page -> figure -> why. Each is quoted
#: from the page's own printed output (a fenced block of the same page, which its own test runs), and
#: the test checks that it is there. The list only shrinks.
NOT_BENCHMARK_FIGURES: dict[str, dict[str, str]] = {}

#: Pages whose running text still quotes measured figures by hand, each with what is left. The list
#: only shrinks: a page leaves it once its figures are rendered (the test then says so).
PROSE_ALLOW: dict[str, str] = {}

NOT_FROM_A_RESULT_FILE = re.compile(r"^<!-- not from a result file: .+ -->$")
_FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.DOTALL | re.MULTILINE)


@functools.cache
def hook():
    """docs/hooks/generate.py, imported as a module (as MkDocs does)."""
    spec = importlib.util.spec_from_file_location("docs_hooks_generate", REPO / "docs" / "hooks" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as MkDocs loads a hook (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def render(page: pathlib.Path) -> str:
    return hook().on_page_markdown(page.read_text(), None, None, None)


def _ids(pages):
    return [str(p.relative_to(DOCS)) for p in pages]


def _table_blocks(markdown: str) -> list[tuple[int, list[str]]]:
    """``(line index of the first row, rows)`` of every table outside code blocks."""
    lines = _FENCE.sub(lambda m: re.sub(r"[^\n]", "", m.group(0)), markdown).splitlines()
    out, start = [], None
    for i, line in enumerate(lines + [""]):
        if line.lstrip().startswith("|"):
            start = i if start is None else start
        elif start is not None:
            out.append((start, lines[start:i]))
            start = None
    return out


def _markers(markdown: str, kind: str) -> list[str]:
    return re.findall(rf"<!-- {kind}: (.+?) -->", markdown)


# --- reading a figure back -------------------------------------------------------------------------

_NUM = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def _read_back(text: str, spec: str, value) -> list[tuple[float, float, float]]:
    """``(shown, expected, tolerance)`` for each number in ``text`` formatted from ``value``."""
    joins = hook().LIST_JOINS
    spec = spec.strip()
    if spec.endswith("-") and len(spec) > 1 and isinstance(value, list):  # a range "low-high", or one figure
        parts = re.split(r"(?<=\d)-(?=\d)", text)
        ends = [min(value), max(value)]
        parts = parts if len(parts) == 2 else parts * 2  # one figure: both ends show as it
        return [t for part, end in zip(parts, ends) for t in _read_back(part, spec[:-1], end)]
    if spec and spec[-1] in joins and spec not in hook().FORMATS:
        parts = text.split(joins[spec[-1]])
        assert len(parts) == len(value), (text, value)
        return [t for part, v in zip(parts, value) for t in _read_back(part, spec[:-1], v)]
    if value is None:
        assert text == "-", (text, value)
        return []
    if spec in ("str", "settings", "counts") or isinstance(value, (str, dict)):
        return []
    m = _NUM.search(text)
    assert m, f"no number in {text!r} (format {spec!r}, value {value!r})"
    shown_text = m.group(0).replace(",", "")
    shown = float(shown_text)
    decimals = len(shown_text.split(".")[1]) if "." in shown_text else 0
    scale = 100.0 if spec in ("pct", "pct0", "p", "p0", "pts") else 1.0
    expected = float(value) * scale
    if spec.endswith("g") and decimals == 0 and abs(expected) >= 1:  # %g rounds to significant digits
        digits = int(re.search(r"\.(\d+)g", spec).group(1))
        tol = 0.5 * 10 ** (math.floor(math.log10(abs(expected))) - digits + 1)
    else:
        tol = 0.5 * 10 ** -decimals
    return [(shown, expected, tol * (1 + 1e-9) + 1e-12)]


def _check_figures(figures, where: str) -> int:
    n = 0
    for expr, spec, value, text in figures:
        for shown, expected, tol in _read_back(text, spec, value):
            assert abs(shown - expected) <= tol, f"{where}: {expr!r} is {expected} but shows {text!r}"
            n += 1
    return n


# --- the markers render ----------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES + OTHER_PAGES, ids=_ids(PAGES + OTHER_PAGES))
def test_every_marker_renders(page):
    out = render(page)
    left = re.findall(r"<!-- (?:value|table|results): .*?-->", out)
    assert left == [], f"{page.name}: markers left after rendering: {left}"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_rendered_table_names_its_file_date_and_command(page):
    src = page.read_text()
    for table_id in _markers(src, "table"):
        if table_id.endswith(".json"):
            text = hook().results_table(table_id)
        else:
            assert table_id in hook().PAGE_TABLES, f"{page.name}: no table {table_id!r} in the hook"
            text = hook().render_table(hook().PAGE_TABLES[table_id])
        source = text.split("\n\nSource: ", 1)
        assert len(source) == 2, f"{page.name}: table {table_id} has no source line"
        assert re.search(r"`benchmarks/results/[\w.-]+\.json` \(committed (\d{4}-\d\d-\d\d|uncommitted)\)",
                         source[1]), source[1]
        assert "made by `" in source[1] or "made by the commands below" in source[1], source[1]
        assert text in render(page), f"{page.name}: table {table_id} is not on the rendered page as rendered"


# --- rendered figures equal their JSON -------------------------------------------------------------

def _page_tables():
    return sorted({t for p in PAGES for t in _markers(p.read_text(), "table") if not t.endswith(".json")})


def test_every_table_of_the_hook_is_on_a_page():
    unused = sorted(set(hook().PAGE_TABLES) - set(_page_tables()))
    assert unused == [], f"tables in docs/hooks/generate.py that no page shows: {unused}"


@pytest.mark.parametrize("table_id", _page_tables())
def test_rendered_table_equals_its_json(table_id):
    table = hook().PAGE_TABLES[table_id]
    heads, rows = hook().table_cells(table)
    assert rows, f"{table_id}: no rows"
    checked = sum(_check_figures(cell.figures, f"{table_id}, {heads[j]!r}")
                  for row in rows for j, cell in enumerate(row))
    assert checked > 0, f"{table_id}: no figure in the table"
    if isinstance(table.rows, str):  # every record of the file is a row, in the file's order
        records = hook().evaluate(table.rows, file=table.file)
        assert len(rows) == len(records)


def test_benchmark_tables_of_the_results_files_equal_their_json():
    for page in PAGES:
        for name in (t for t in _markers(page.read_text(), "table") if t.endswith(".json")):
            data = json.loads((REPO / "benchmarks" / "results" / name).read_text())["table"]
            text = hook().results_table(name)
            for row in data["rows"]:
                assert "| " + " | ".join(str(c) for c in row) + " |" in text


@pytest.mark.parametrize("page", PAGES + OTHER_PAGES, ids=_ids(PAGES + OTHER_PAGES))
def test_figures_in_the_text_equal_their_json(page):
    for spec in _markers(page.read_text(), "value"):
        body, _, form = spec.rpartition("|")
        text = hook().value_marker(spec)
        first = body.split(None, 1)
        file, expr = (first[0], first[1]) if first[0].endswith(".json") and ":" not in first[0] else (None, body)
        value = hook().evaluate(expr.strip(), file=file)
        _check_figures([(expr, form, value, text)], f"{page.name}: <!-- value: {spec} -->")


def _results(name: str):
    return json.loads((REPO / "benchmarks" / "results" / name).read_text())


def _row(table_id: str, first_cell: str) -> list[str]:
    _, rows = hook().table_cells(hook().PAGE_TABLES[table_id])
    found = [[c.text.replace("**", "") for c in row] for row in rows
             if row[0].text.replace("**", "") == first_cell or row[1].text == first_cell]
    assert len(found) == 1, (table_id, first_cell)
    return found[0]


def test_rows_recomputed_from_the_json_directly():
    """The hook's expressions (selections, medians, means, ratios) against plain Python on the JSON."""
    fed = next(r for r in _results("federated.json")["results"] if r["partitioner"] == "dirichlet"
               and r["case"] == "stc 0.0025+EF avgm")
    row = _row("federated", "stc 0.0025+EF avgm")
    assert row[2] == f"{100 * sum(fed['final_accuracy_per_seed']) / len(fed['final_accuracy_per_seed']):.1f} %"
    assert row[-1] == f"{fed['compression_ratio']:.0f}x"

    both = _results("both_ways.json")
    default = [r for r in both["runs"] if r["case"] == "default (stc 5 % down, seeded start)"]
    fp32 = [r for r in both["runs"] if r["case"] == "fp32 both ways"]
    med = sorted(r["final_accuracy"] for r in default)[1]
    total = sorted(r["upload_bytes"] + r["download_bytes"] for r in default)[1]
    row = _row("both-ways/cnn", "the default: STC 5 % down, seeded start")
    assert row[1] == f"{100 * med:.1f} %"
    assert row[2] == f"{100 * (med - sorted(r['final_accuracy'] for r in fp32)[1]):+.1f}"
    assert row[-1] == f"{2 * fp32[0]['fp32_one_way_bytes'] / total:.0f}x"

    ddp = [r for r in _results("ddp_hook.json")["runs"] if r["side"] == "fedcomp stc 0.01"]
    row = _row("ddp-hook", "fedcomp STC, density 0.01")
    assert row[1] == f"{sum(r['bytes_per_step'] for r in ddp) / len(ddp) / 1000:.2f} kB"
    assert row[2] == f"{sum(r['ratio'] for r in ddp) / len(ddp):.1f}x"

    gains = [_results(f"llm_lora_{s}.json")["lora"] for s in (42, 43, 44)]
    preset = sorted(next(r["gain_kept"] for r in g["results"] if r["case"] == "sign+EF") for g in gains)
    row = _row("llm/lora-seeds", "sign+EF (sign / sign), the `lora` preset")
    assert row[2] == f"{100 * preset[1]:.1f} %"


# --- no hand-typed figures -------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_table_is_rendered_or_says_it_is_not_from_a_benchmark(page):
    lines = page.read_text().splitlines()
    for start, rows in _table_blocks(page.read_text()):
        above = next((lines[i].strip() for i in range(start - 1, -1, -1) if lines[i].strip()), "")
        assert NOT_FROM_A_RESULT_FILE.match(above), (
            f"{page.name}:{start + 1}: a hand-typed table ({rows[0][:60]}...): render it from its result file "
            "(<!-- table: ID --> and docs/hooks/generate.py's PAGE_TABLES), or say above it "
            "<!-- not from a result file: why -->")


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_no_code_block_holds_benchmark_output(page):
    for block in _FENCE.finditer(page.read_text()):
        numeric = [line for line in block.group(0).splitlines()
                   if len(re.findall(r"\b\d+\.\d+\b", line)) >= 3]
        assert len(numeric) < 3, f"{page.name}: a code block of figures (pasted output?): {numeric[:2]}"


def _prose(markdown: str) -> str:
    markdown = _FENCE.sub("", markdown)
    markdown = re.sub(r"<!--.*?-->", "", markdown, flags=re.DOTALL)
    markdown = re.sub(r"`[^`\n]*`", "", markdown)
    return "\n".join(line for line in markdown.splitlines() if not line.lstrip().startswith("|"))


#: a measured percentage or ratio typed by hand: a decimal number followed by % or x (targets such as
#: ">= 1.03x" are bounds, not figures)
HAND_TYPED = re.compile(r"(?<![<>=] )(?<![\d.])\d+\.\d+(?: ?%|x\b)")


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_running_text_quotes_no_measured_figure_by_hand(page):
    found = HAND_TYPED.findall(_prose(page.read_text()))
    if page.name in PROSE_ALLOW:
        if not found:
            pytest.fail(f"{page.name} renders its figures now: remove it from PROSE_ALLOW")
        pytest.xfail(PROSE_ALLOW[page.name])
    assert found == [], f"{page.name}: figures typed by hand (render them with <!-- value: ... -->): {found}"


def test_the_allow_list_names_pages_that_exist():
    assert [n for n in PROSE_ALLOW if not (REPO / "docs" / "benchmarks" / n).exists()] == []
    assert [n for n in NOT_BENCHMARK_FIGURES if not (DOCS / n).exists()] == []


def _text(markdown: str) -> str:
    """The page's words as a reader sees them, tables included: no code, no comments (markers)."""
    markdown = _FENCE.sub("", markdown)
    markdown = re.sub(r"<!--.*?-->", "", markdown, flags=re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", markdown)


@pytest.mark.parametrize("page", OTHER_PAGES, ids=_ids(OTHER_PAGES))
def test_other_pages_quote_no_benchmark_figure_by_hand(page):
    """A decimal percentage or ratio on a page outside docs/benchmarks/ is rendered from its result file
    (<!-- value: ... -->), or listed in NOT_BENCHMARK_FIGURES with why it is no benchmark result."""
    allowed = NOT_BENCHMARK_FIGURES.get(str(page.relative_to(DOCS)), {})
    found = HAND_TYPED.findall(_text(page.read_text()))
    typed = [f for f in found if f not in allowed]
    assert typed == [], (f"{page.relative_to(REPO)}: figures typed by hand (render them with <!-- value: FILE EXPR "
                         f"| FORMAT -->, or rephrase where no result file holds them): {typed}")
    gone = sorted(set(allowed) - set(found))
    assert gone == [], f"{page.relative_to(REPO)}: no longer typed, remove from NOT_BENCHMARK_FIGURES: {gone}"


@pytest.mark.parametrize("name", sorted(NOT_BENCHMARK_FIGURES))
def test_figures_allowed_outside_the_benchmarks_are_the_pages_own_output(name):
    text = (DOCS / name).read_text()
    printed = "\n".join(m.group(0) for m in _FENCE.finditer(text))
    missing = [f for f in NOT_BENCHMARK_FIGURES[name] if f not in printed]
    assert missing == [], f"docs/{name}: {missing} are not in the page's printed output: render or rephrase them"


# --- the README's figures ----------------------------------------------------------------------------

def _wire(case: str, field: str, form: str, sign: str = "") -> str:
    return f"wire.json {sign}medians[case={case}].{field} | {form}"


def _upload(case: str) -> str:
    return f"federated.json results[partitioner=dirichlet;case={case}].compression_ratio | x"


#: The README is not rendered by MkDocs, so it types its headline figures: each line of it here, with
#: ``{}`` where a figure stands and the value specs (as in ``<!-- value: ... -->``) that give them.
README_FIGURES: list[tuple[str, tuple[str, ...]]] = [
    ("| fp32 both ways (`compressor = \"none\"`) | {} | {} | {} |",
     (_wire("reference: fp32 both ways", "accuracy", "pct"), _wire("reference: fp32 both ways", "mb", ".1f"),
      _wire("reference: fp32 both ways", "ratio", "x"))),
    ("seeded first model, evaluation on the compressed download | {} | {} | **{}** |",
     (_wire("reference: defaults", "accuracy", "pct"), _wire("reference: defaults", "mb", ".2f"),
      _wire("reference: defaults", "ratio", "x"))),
    ("| without fedcomp (plain FedAvg) | {} | {} | {} |",
     (_wire("existing app: plain FedAvg", "accuracy", "pct"), _wire("existing app: plain FedAvg", "mb", ".1f"),
      _wire("existing app: plain FedAvg", "ratio", "x"))),
    ("| + the two lines, `compressor=\"sign\"` (`sign` down) | {} | {} | **{}** |",
     (_wire("existing app + two lines, sign", "accuracy", "pct"), _wire("existing app + two lines, sign", "mb", ".2f"),
      _wire("existing app + two lines, sign", "ratio", "x"))),
    ("| + the two lines, the default codec (STC 0.01 up, STC 0.05 down) | {} | {} | **{}** |",
     (_wire("existing app + two lines, default codec", "accuracy", "pct"),
      _wire("existing app + two lines, default codec", "mb", ".2f"),
      _wire("existing app + two lines, default codec", "ratio", "x"))),
    ("the same app ends {} points below plain FedAvg with `sign` and {} with the default codec",
     (_wire("existing app, 1 local epoch: sign", "accuracy-vs-fp32", "p", sign="-"),
      _wire("existing app, 1 local epoch: default codec", "accuracy-vs-fp32", "p", sign="-"))),
    ("the legacy two lines save {} with `sign` and {} with the default codec; under `secagg = true` the run saves {} "
     "both ways, {} points against fp32",
     (_wire("legacy API + two lines, sign", "ratio", "x"), _wire("legacy API + two lines, default codec", "ratio", "x"),
      _wire("secagg = true (default download)", "ratio", "x"),
      _wire("secagg = true (default download)", "accuracy-vs-fp32", "pts"))),
    ("int8 {}, sign + error feedback {},", (_upload("int8"), _upload("sign+EF"))),
    ("STC 0.01 {}, all within about a point of fp32", (_upload("stc 0.01+EF"),)),
]


@pytest.mark.parametrize("line, specs", README_FIGURES, ids=[f"README-{i}" for i in range(len(README_FIGURES))])
def test_readme_figures_equal_their_json(line, specs):
    text = " ".join((REPO / "README.md").read_text().split())
    expected = line.format(*(hook().value_marker(spec) for spec in specs))
    assert expected in text, f"README.md should read {expected!r} (from benchmarks/results/)"


def test_readme_types_no_figure_that_readme_figures_does_not_check():
    """A new decimal percentage or ratio in the README gets a line in README_FIGURES."""
    text = " ".join(_text((REPO / "README.md").read_text()).split())
    checked = " ".join(line.format(*(hook().value_marker(s) for s in specs)) for line, specs in README_FIGURES)
    assert [f for f in HAND_TYPED.findall(text) if f not in checked] == []


# --- the result files ----------------------------------------------------------------------------------

MACHINE_PATH = re.compile(r"(?<![\w.])/(?:tmp|work|home|root|Users)/")


@pytest.mark.parametrize("path", RESULT_FILES, ids=[p.name for p in RESULT_FILES])
def test_result_files_name_no_machine_path(path):
    """A result file records what a user can rerun: no path of the machine that ran it (the pages print
    its commands)."""
    hits = [m.group(0) + path.read_text()[m.end():m.end() + 40] for m in MACHINE_PATH.finditer(path.read_text())]
    assert hits == [], f"benchmarks/results/{path.name}: machine paths {hits}"


def _commands(data) -> list[str]:
    if not isinstance(data, dict):
        return []
    found = [data["command"]] if isinstance(data.get("command"), str) else []
    return found + [c for c in data.get("commands") or [] if isinstance(c, str)]


@pytest.mark.parametrize("path", RESULT_FILES, ids=[p.name for p in RESULT_FILES])
def test_recorded_commands_are_what_a_user_types(path):
    """Each recorded command runs a benchmark script of the repository from its root, and says what
    it runs, not how it came about (no notes on what the code did when it ran)."""
    for command in _commands(json.loads(path.read_text())):
        script = re.match(r"^(?:sudo )?python (benchmarks/\w+\.py)\b", command)
        assert script or command.startswith("("), f"{path.name}: {command!r} is not a command"
        assert not script or (REPO / script.group(1)).is_file(), f"{path.name}: {command!r}: no such script"
        assert not re.search(r"\b(?:existed|now named|formerly|previously|at the time)\b", command), (
            f"{path.name}: {command!r} holds a history note; name the cases as the script names them now")


# --- the figures follow the files ------------------------------------------------------------------

def test_a_changed_result_file_changes_the_page(tmp_path, monkeypatch):
    results = tmp_path / "results"
    shutil.copytree(REPO / "benchmarks" / "results", results)
    data = json.loads((results / "federated.json").read_text())
    row = next(r for r in data["results"] if r["partitioner"] == "dirichlet" and r["case"] == "sign+EF")
    row["final_accuracy"] = 0.4321
    (results / "federated.json").write_text(json.dumps(data))
    monkeypatch.setattr(hook(), "RESULTS_DIR", results)
    page = render(REPO / "docs" / "benchmarks" / "federated.md")
    assert "| dirichlet | sign+EF | 43.2 % |" in page
    assert "43.2 % (gap" in page  # the running text follows too
    faq = render(DOCS / "faq.md")  # and a page outside docs/benchmarks/
    assert "| `sign` with error feedback | 43.2 %, the same as fp32" in faq


# --- the expressions -------------------------------------------------------------------------------

def test_expressions_select_and_combine():
    ev = hook().evaluate
    assert ev("[k=b].v", root=[{"k": "a", "v": 1}, {"k": "b", "v": 2}]) == 2
    assert ev("[?k=a].v", root=[{"k": "a", "v": 1}, {"k": "a", "v": 3}, {"k": "b", "v": 2}]) == [1, 3]
    assert ev("[?k!=a].v", root=[{"k": "a", "v": 1}, {"k": "b", "v": 2}]) == [2]
    assert ev("median([*].v) - 1", root=[{"v": 1}, {"v": 5}, {"v": 3}]) == 2
    assert ev("a[*] - b[*]", root={"a": [3, 4], "b": [1, 1]}) == [2, 3]
    assert ev("-max(a[*])", root={"a": [3, 4]}) == -4
    assert ev("[key with spaces].x?", root={"key with spaces": {"y": 1}}) is None
    with pytest.raises(ValueError, match="matches 2 items"):
        ev("[k=a].v", root=[{"k": "a", "v": 1}, {"k": "a", "v": 3}])
    with pytest.raises(ValueError):
        ev("[k=c].v", root=[{"k": "a", "v": 1}])


def test_formats():
    fmt = hook().fmt
    assert fmt(0.9708, "pct") == "97.1 %"
    assert fmt(-0.0003, "pts") == "+0.0"
    assert fmt(-0.0236, "pts") == "-2.4"
    assert fmt(17204.2, "x,") == "17,204x"
    assert fmt([17, None], "int,") == "17, -"
    assert fmt([0.975, 0.9667], "p/") == "97.5 / 96.7"
    assert fmt(None, ".3f") == "-"
