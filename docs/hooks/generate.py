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
* ``<!-- table: ID -->``: a table of :data:`PAGE_TABLES`, rendered from result files that hold records
  rather than a finished table (which records, which fields, how formatted), without rerunning the
  benchmark; under it the command that made each file (the file's ``command``/``commands`` if it
  records them, else the spec's, taken from the benchmark script's usage) and the file's commit date.
* ``<!-- value: [NAME.json] EXPR | FORMAT -->``: one figure in running text, replaced in place by
  ``EXPR`` evaluated against the result file and formatted (:func:`evaluate`, :data:`FORMATS`).

An expression (:func:`evaluate`) is arithmetic (``+ - * /`` between spaces, parentheses, numbers and
:data:`FUNCTIONS` such as ``median(...)``) over paths into a result file: ``a.b`` (keys),
``[3]`` / ``[-1]`` (list items), ``[*]`` (every item), ``[case=sign+EF;partitioner=iid]`` (the one
item whose fields match; ``!=``, ``>=``, ``<=`` too), ``[?partitioner=iid]`` (every item that
matches), ``[some key]`` (a key with spaces), ``key?`` (a field some records lack: None there, shown
"-"). A path starts at the marker's file, at a table row's record (``@`` alone: the record), at
``$`` (the table's file), at ``NAME.json:`` (another result file) or at ``#ID:`` (the records of a
table of :data:`PAGE_TABLES`). Lists combine item by item (``a[*].x - b[*].x``).

A table on a benchmark page that no result file holds (a list of pages, figures reported by someone
else) says so on the line above it: ``<!-- not from a result file: why -->``;
``tests/test_docs_figures.py`` holds every other table to be rendered here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re
import statistics
import subprocess
import sys
import typing

REPO = pathlib.Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the docs build from a checkout without an editable install too
    sys.path.insert(0, str(REPO))

RUN_CONFIG = re.compile(r"^<!-- run-config-reference -->$", re.MULTILINE)
CODEC_REF = re.compile(r"^<!-- codec-reference -->$", re.MULTILINE)
INCLUDE = re.compile(r"^<!-- include: (?P<path>[\w./-]+) -->$", re.MULTILINE)
RESULTS = re.compile(r"^<!-- results: (?P<names>[\w., -]+) -->$", re.MULTILINE)
TABLE = re.compile(r"^<!-- table: (?P<name>[\w.-]+\.json) -->$", re.MULTILINE)

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


@functools.cache
def _commit_date(path: pathlib.Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%cs", "--", str(path)],
                             capture_output=True, text=True, timeout=30, check=False)
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
    data = result(name)
    if "table" not in data:
        raise ValueError(f"benchmarks/results/{name} holds no 'table' for the page to show")
    cols, rows = data["table"]["columns"], data["table"]["rows"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n\n" + source_line([name])


# ---------------------------------------------------------------------------------------------------
# Figures from result files: expressions, formats, tables
# ---------------------------------------------------------------------------------------------------

RESULTS_DIR = REPO / "benchmarks" / "results"
SPEC_TABLE = re.compile(r"^<!-- table: (?P<id>[\w/-]+) -->$", re.MULTILINE)
VALUE = re.compile(r"<!-- value: (?P<spec>.+?) -->")
#: a placeholder of a cell template: ``{EXPR|FORMAT}``
_PLACEHOLDER = re.compile(r"\{(?P<expr>[^{}|]+)\|(?P<fmt>[^{}]*)\}")


def result(name: str):
    """The parsed JSON of ``benchmarks/results/NAME`` (read again when the file changes)."""
    path = RESULTS_DIR / name
    if not path.is_file():
        raise ValueError(f"benchmark page names benchmarks/results/{name}, which does not exist")
    return _load(str(path), path.stat().st_mtime_ns)


@functools.cache
def _load(path: str, mtime_ns: int):
    return json.loads(pathlib.Path(path).read_text())


def _tokens(text: str) -> list[str]:
    """``text`` split at white space, parentheses and commas outside ``[...]``."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c in "(),-":  # a '-' that starts a token is an operator: paths do not start with one
            out.append(c)
            i += 1
        else:
            j, depth = i, 0
            while j < n and (depth or not (text[j].isspace() or text[j] in "(),")):
                depth += {"[": 1, "]": -1}.get(text[j], 0)
                j += 1
            if depth:
                raise ValueError(f"unbalanced [ ] in {text!r}")
            out.append(text[i:j])
            i = j
    return out


_NUMBER = re.compile(r"^\d+(?:\.\d*)?(?:e[+-]?\d+)?$")
_SEGMENT = re.compile(r"\[(?P<sel>[^\]]*)\]|\.?(?P<key>[^.\[\]]+)")


def _median(*values):
    return statistics.median(_flat(values))


def _mean(*values):
    return statistics.fmean(_flat(values))


def _flat(values):
    """The arguments of an aggregate as one list: list arguments (and lists in them) give their items."""
    return [x for v in values for x in (_flat(v) if isinstance(v, list) else [v])]


#: functions an expression may call; one list argument or several values
FUNCTIONS = {
    "median": _median, "mean": _mean, "min": lambda *v: min(_flat(v)), "max": lambda *v: max(_flat(v)),
    "sum": lambda *v: sum(_flat(v)), "len": lambda v: len(v), "abs": lambda v: _elementwise(abs, v),
    "sorted": lambda v: sorted(v), "list": lambda *v: list(v), "sd": lambda *v: statistics.stdev(_flat(v)),
    "first": lambda v: v[0], "last": lambda v: v[-1],
    # first round whose accuracy reaches the target (1-based: a curve's item 0 is round 0)
    "reach": lambda curve, target: next((i for i, a in enumerate(curve) if i and a >= target), None),
    # per item of a list of lists (per-seed curves): its largest value, and where it is
    "max_each": lambda v: [max(x) for x in v], "argmax_each": lambda v: [x.index(max(x)) for x in v],
    "argmin": lambda v: v.index(min(v)), "min_each": lambda v: [min(x) for x in v],
    "sqrt": lambda v: _elementwise(lambda x: x ** 0.5, v),
    "met_if_at_most": lambda value, target: "met" if value <= target else "not met",
    "yes_if_all": lambda v: "yes" if all(_flat([v])) else "no",
    "reach_each": lambda curves, target: [FUNCTIONS["reach"](c, target) for c in curves],
    "mean_last_each": lambda curves, n: [_mean(c[-int(n):]) for c in curves],
    # benchmarks/both_ways.py's bytes_to: bytes both ways until a run first reaches the target
    "bytes_to_each": lambda accs, sent, target: [_bytes_to(a, b, target) for a, b in zip(accs, sent)],
}


def _bytes_to(curve: list, sent: list, target: float):
    total = 0.0
    for acc, step in zip(curve, sent):
        total += step
        if acc >= target and total > 0:
            return total
    return None


def _elementwise(fn, *args):
    lists = [a for a in args if isinstance(a, list)]
    if not lists:
        return None if any(a is None for a in args) else fn(*args)
    n = len(lists[0])
    if any(len(x) != n for x in lists):
        raise ValueError("lists of different lengths in one expression")
    return [_elementwise(fn, *(a[i] if isinstance(a, list) else a for a in args)) for i in range(n)]


_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


class _Parser:
    """Recursive descent over :func:`_tokens`: ``expr := term (('+'|'-') term)*`` and so on."""

    def __init__(self, text: str, root, file: str | None):
        self.text, self.toks, self.i, self.root, self.file = text, _tokens(text), 0, root, file
        self.files: set[str] = set()

    def parse(self):
        value = self.expr()
        if self.i != len(self.toks):
            raise ValueError(f"unexpected {self.toks[self.i]!r} in {self.text!r}")
        return value

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise ValueError(f"expected {want or 'more'} in {self.text!r}")
        self.i += 1
        return tok

    def expr(self):
        value = self.term()
        while self.peek() in ("+", "-"):
            op = _OPS[self.take()]
            value = _elementwise(op, value, self.term())
        return value

    def term(self):
        value = self.unary()
        while self.peek() in ("*", "/"):
            op = _OPS[self.take()]
            value = _elementwise(op, value, self.unary())
        return value

    def unary(self):
        if self.peek() == "-":
            self.take()
            return _elementwise(lambda v: -v, self.unary())
        return self.atom()

    def atom(self):
        tok = self.take()
        if tok == "(":
            value = self.expr()
            self.take(")")
            return value
        if _NUMBER.match(tok):
            return float(tok)
        if tok in FUNCTIONS and self.peek() == "(":
            self.take("(")
            args = []
            while self.peek() != ")":
                args.append(self.expr())
                if self.peek() == ",":
                    self.take()
            self.take(")")
            return FUNCTIONS[tok](*args)
        return self.path(tok)

    def path(self, tok: str):
        m = re.match(r"^([\w.-]+\.json):", tok)
        t = re.match(r"^#([\w/-]+):", tok)
        if t:  # '#ID:': the records of a table of PAGE_TABLES (those its rows function computes)
            table = PAGE_TABLES[t.group(1)]
            self.files.add(table.file)
            node, rest = table_records(table), tok[t.end():]
        elif m:
            self.files.add(m.group(1))
            node, rest = result(m.group(1)), tok[m.end():]
        elif tok.startswith("$"):
            if self.file is None:
                raise ValueError(f"{tok!r}: no file for '$' here")
            self.files.add(self.file)
            node, rest = result(self.file), tok[1:]
        else:
            node, rest = self.root, tok
        rest = rest.removeprefix("@")  # '@': the record (or the file) itself
        segments, pos = [], 0
        while pos < len(rest):
            seg = _SEGMENT.match(rest, pos)
            if not seg or seg.end() == pos:
                raise ValueError(f"cannot read path {tok!r} at {rest[pos:]!r}")
            segments.append(seg)
            pos = seg.end()
        try:
            return _walk(node, segments)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"path {tok!r}: {e}") from None


def _matches(value, want: str) -> bool:
    """Whether a record's field (None when absent) is ``want`` as written in a selection."""
    if value is None:
        return want == "null"
    if isinstance(value, bool):
        return str(value).lower() == want.lower()
    if isinstance(value, (int, float)):
        try:
            return float(want) == value
        except ValueError:
            return False
    return str(value) == want


def _select(items: list, sel: str) -> list:
    """The items matching every ``key=value``, ``key!=value``, ``key>=number`` or ``key<=number`` of
    ``sel`` (``;``-separated)."""
    conds = [re.match(r"^\s*([^=!<>]+?)\s*(!=|>=|<=|=)\s*(.*?)\s*$", c).groups() for c in sel.split(";")]
    return [x for x in items if isinstance(x, dict) and all(_holds(x.get(k), op, v) for k, op, v in conds)]


def _holds(value, op: str, want: str) -> bool:
    if op in ("=", "!="):
        return _matches(value, want) == (op == "=")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return value >= float(want) if op == ">=" else value <= float(want)


def _walk(node, segments):
    for n, seg in enumerate(segments):
        key, sel = seg.group("key"), seg.group("sel")
        if key is not None:
            if isinstance(node, list):
                raise TypeError(f"{key!r} on a list (use [*] or a selection)")
            if key.endswith("?"):  # an optional field: None (shown "-") where a record has none
                node = node.get(key[:-1])
                if node is None:
                    return None
            else:
                node = node[key]
            continue
        sel = sel.strip()
        if isinstance(node, dict):
            node = node[sel]
        elif sel == "*":
            return [_walk(x, segments[n + 1:]) for x in node]
        elif re.fullmatch(r"-?\d+", sel):
            node = node[int(sel)]
        elif sel.startswith("?"):
            return [_walk(x, segments[n + 1:]) for x in _select(node, sel[1:])]
        elif "=" in sel:
            found = _select(node, sel)
            if len(found) != 1:
                raise ValueError(f"[{sel}] matches {len(found)} items, not one")
            node = found[0]
        else:
            raise ValueError(f"[{sel}] on a list")
    return node


def evaluate(expr: str, root=None, file: str | None = None, files: set | None = None):
    """The value of ``expr`` (see the module docstring); paths start at ``root``, ``$`` at ``file``.

    The result files it read are added to ``files`` when given.
    """
    parser = _Parser(expr, root if root is not None else (result(file) if file else None), file)
    value = parser.parse()
    if files is not None:
        files |= parser.files | ({file} if file and root is None else set())
    return value


def _pts(v: float) -> str:
    text = f"{100 * v:+.1f}"
    return "+0.0" if text == "-0.0" else text


#: named formats (anything else is a Python format spec such as ``.3f`` or ``,.0f``); None is "-"
FORMATS = {
    "pct": lambda v: f"{100 * v:.1f} %",      # a fraction as a percentage: 0.971 -> "97.1 %"
    "pct0": lambda v: f"{100 * v:.0f} %",
    "p": lambda v: f"{100 * v:.1f}",          # the same without the sign: "97.1"
    "p0": lambda v: f"{100 * v:.0f}",
    "pts": _pts,                              # a difference of fractions in points: "+1.7", "-0.3"
    "x": lambda v: f"{v:.0f}x",               # a ratio: "316x"
    "x1": lambda v: f"{v:.1f}x",
    "x2": lambda v: f"{v:.2f}x",
    "x,": lambda v: f"{v:,.0f}x",             # "17,204x"
    "int": lambda v: f"{v:.0f}",
    "n,": lambda v: f"{v:,.0f}",              # "38,282"
    "str": str,
    "counts": lambda d: ", ".join(f"{k} {n}" for k, n in d.items()),  # {"init+diff": 9, "payload": 1}
    # a codec record's settings: "density=0.01", "levels=7, spacing=exponential" ("" for none)
    "settings": lambda rec: ", ".join(f"{k}={rec[k]}" for k in _SETTINGS if k in rec) or "",
}
_SETTINGS = ("block_size", "levels", "spacing", "density", "rank", "unbiased")
#: joins for list values: FORMAT followed by one of these formats every item and joins them
LIST_JOINS = {"/": " / ", ",": ", ", ";": "; "}


def fmt(value, spec: str) -> str:
    """``value`` formatted by ``spec`` (:data:`FORMATS` or a Python format spec); a list item by item
    when ``spec`` ends in one of :data:`LIST_JOINS` (``pct/``: "97.5 / 94.7 / 96.1"), or as a range
    when it ends in ``-`` (``x1-``: "1.6-2.0x"; one figure where both ends look the same)."""
    spec = spec.strip()
    if spec.endswith("-") and len(spec) > 1 and isinstance(value, list):  # a range: "1.7-2.4 s", "4.5x"
        low, high = fmt(min(value), spec[:-1]), fmt(max(value), spec[:-1])
        unit = re.search(r"[^\d.]*$", high).group(0)
        return low if low == high else low.removesuffix(unit) + "-" + high
    if spec and spec[-1] in LIST_JOINS and spec not in FORMATS:
        if not isinstance(value, list):
            raise TypeError(f"format {spec!r} wants a list, got {value!r}")
        return LIST_JOINS[spec[-1]].join(fmt(v, spec[:-1]) for v in value)
    if value is None:
        return "-"
    if isinstance(value, list):
        raise TypeError(f"a list {value!r} needs a joining format (e.g. {spec}/)")
    if spec in FORMATS:
        return FORMATS[spec](value)
    return format(value, spec)


def value_marker(spec: str) -> str:
    """The text of ``<!-- value: [NAME.json] EXPR | FORMAT -->``."""
    body, sep, form = spec.rpartition("|")
    if not sep:
        raise ValueError(f"value marker {spec!r}: no '| FORMAT'")
    body = body.strip()
    file = None
    first = body.split(None, 1)
    if first and first[0].endswith(".json") and ":" not in first[0]:
        file, body = first[0], (first[1] if len(first) > 1 else "")
    try:
        return fmt(evaluate(body, file=file), form)
    except Exception as e:  # noqa: BLE001 - the build names the marker
        raise ValueError(f"<!-- value: {spec} -->: {e}") from None


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a :class:`Table` whose rows are named one by one.

    ``label``: the text of the first column (what the row is: words, not figures); ``at``: the
    expression of the row's record; ``bold``: the headers (or indexes) of the cells shown bold (``"*"``: all);
    ``cells``: header -> this row's own template, where the table's does not fit it.
    """

    label: str
    at: str
    bold: tuple[str | int, ...] | str = ()
    cells: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Table:
    """A table rendered from a result file.

    ``file``: the result file (``$`` in the templates); ``columns``: ``(header, template)`` or
    ``(header, template, alignment)`` per column, a template being text with ``{EXPR|FORMAT}``
    placeholders evaluated against the row's record, ``{label}`` for a :class:`Row`'s label and
    ``<<key>>`` for the record's field ``key`` (to reach its other records, e.g. per-seed runs); a
    header may hold placeholders too, evaluated against the file;
    ``rows``: an expression that gives the records (in the file's order), a function of the file's
    data that computes them (with the benchmark's own functions, :func:`benchmark`), or one
    :class:`Row` each;
    ``command``: what made the file when it records no ``command``/``commands`` (a function of the
    file's name where it differs per file; default: the usage line of the benchmark script the file
    is named after).
    """

    file: str
    columns: tuple
    rows: str | typing.Callable | tuple[Row, ...]
    command: str | typing.Callable[[str], str] = ""


@dataclasses.dataclass
class Cell:
    """A rendered cell: its text, and each figure in it as ``(expression, format, value, text)``."""

    text: str
    figures: list[tuple[str, str, object, str]]


def table_cells(table: Table, files: set | None = None) -> tuple[list[str], list[list[Cell]]]:
    """The headers and the rendered cells of ``table``; the result files read go into ``files``."""
    files = set() if files is None else files
    files.add(table.file)
    if isinstance(table.rows, str) or callable(table.rows):
        rows = [(None, rec, Row("", "")) for rec in table_records(table, files)]
    else:
        rows = [(r.label, evaluate(r.at, file=table.file, files=files), r) for r in table.rows]
    heads = [_PLACEHOLDER.sub(lambda m: fmt(evaluate(m.group("expr"), file=table.file, files=files), m.group("fmt")),
                              c[0]) for c in table.columns]
    out = []
    for label, rec, spec in rows:
        cells = []
        for col in table.columns:
            head, template = col[0], spec.cells.get(col[0], col[1])  # a Row's own cells name the spec's header
            if isinstance(rec, dict):  # <<key>>: the row record's field, for paths to its other records
                template = re.sub(r"<<(\w+)>>", lambda m, rec=rec: _field(rec, m.group(1)), template)
            figures = []

            def one(m, rec=rec, figures=figures, label=label, head=head):
                try:
                    value = evaluate(m.group("expr"), root=rec, file=table.file, files=files)
                    text = fmt(value, m.group("fmt"))
                except Exception as e:  # noqa: BLE001 - the build names the cell
                    raise ValueError(f"table on {table.file}, row {label or rec!r:.80}, column {head!r}: {e}") from None
                figures.append((m.group("expr").strip(), m.group("fmt").strip(), value, text))
                return text

            text = _PLACEHOLDER.sub(one, template.replace("{label}", label or ""))  # a label's own {..|..} too
            if text and (spec.bold == "*" or head in spec.bold or len(cells) in spec.bold):
                text = f"**{text}**"
            cells.append(Cell(text, figures))
        out.append(cells)
    return heads, out


def _field(rec: dict, key: str) -> str:
    value = rec[key]
    if isinstance(value, list) and len(value) == 1:  # e.g. the seeds of a one-seed row
        value = value[0]
    return str(value)


def table_records(table: Table, files: set | None = None) -> list:
    """The records of a table whose rows are not named one by one: its expression's, or what its
    rows function computes from the file (``rows(data)``)."""
    if callable(table.rows):
        if files is not None:
            files.add(table.file)
        return table.rows(result(table.file))
    return evaluate(table.rows, file=table.file, files=files)


@functools.cache
def benchmark(name: str):
    """``benchmarks/NAME.py`` as a module, for a table that a benchmark's own functions compute from
    its result file (imported once per build)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"fedcomp_benchmark_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def _script_usage(stem: str) -> str:
    """``python benchmarks/SCRIPT.py`` from the script's ``Run:`` line, its optional ``[...]`` left out."""
    path = REPO / "benchmarks" / f"{stem}.py"
    m = re.search(r"Run: ``(python benchmarks/[^`]+)``", path.read_text())
    if not m:
        return f"python benchmarks/{stem}.py"
    return re.sub(r"\s*\[[^\]]*\]", "", m.group(1)).strip()


def commands(name: str, given: str | typing.Callable[[str], str] = "") -> list[str]:
    """What made ``benchmarks/results/NAME``: the file's own record, else ``given``, else its script's usage."""
    data = result(name)
    if isinstance(data, dict) and isinstance(data.get("commands"), list) and data["commands"]:
        return [str(c) for c in data["commands"]]
    if isinstance(data, dict) and isinstance(data.get("command"), str) and data["command"]:
        return [data["command"]]
    if given:
        return [given(name) if callable(given) else given]
    stem = pathlib.Path(name).stem.replace("-", "_")
    scripts = sorted((p.stem for p in (REPO / "benchmarks").glob("*.py") if stem.startswith(p.stem)), key=len)
    if not scripts:
        raise ValueError(f"no command for benchmarks/results/{name}: give the table one")
    return [_script_usage(scripts[-1])]


def source_line(files: list[str], given: str | typing.Callable[[str], str] = "") -> str:
    """Under a table: each result file with its commit date, and the command(s) that made it (one
    inline, more in a collapsed note)."""
    where = ", ".join(f"`benchmarks/results/{n}` (committed {_commit_date(RESULTS_DIR / n)})" for n in files)
    made = [(n, commands(n, given)) for n in files]
    distinct = list(dict.fromkeys(c for _, cmds in made for c in cmds))
    if len(distinct) == 1:
        return f"Source: {where}; made by `{distinct[0]}`."
    text = f"Source: {where}; made by the commands below."
    title = "The commands that made " + ", ".join(n for n, _ in made)
    items = "".join(f"    - `{c}`\n" if len(made) == 1 else f"    - {n}: `{c}`\n" for n, cmds in made for c in cmds)
    return f"{text}\n\n??? note \"{title}\"\n{items}"


def render_table(table: Table) -> str:
    """Markdown: ``table``'s rows, then :func:`source_line`."""
    files: set[str] = set()
    heads, rows = table_cells(table, files)
    aligns = [col[2] if len(col) > 2 else "---" for col in table.columns]
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join(aligns) + "|"]
    lines += ["| " + " | ".join(c.text for c in row) + " |" for row in rows]
    ordered = [table.file] + sorted(files - {table.file})
    return "\n".join(lines) + "\n\n" + source_line(ordered, table.command)


def spec_table(table_id: str) -> str:
    if table_id not in PAGE_TABLES:
        raise ValueError(f"<!-- table: {table_id} -->: no such table in docs/hooks/generate.py's PAGE_TABLES")
    return render_table(PAGE_TABLES[table_id])


#: ``<!-- table: ID -->`` -> the table; see the page-by-page specs below
PAGE_TABLES: dict[str, Table] = {}

# --- federated.md, accuracy.md: benchmarks/federated.py's records (one per partition and case)
_FEDERATED_COLUMNS = (
    ("partition", "{partitioner|str}"), ("codec", "{case|str}"), ("final acc. (mean)", "{final_accuracy|pct}"),
    ("rounds to 90 % (per seed)", "{rounds_to_90|int,}"), ("rounds to 95 % (per seed)", "{rounds_to_95|int,}"),
    ("upload MB", "{upload_mb|.3f}"), ("download MB", "{download_mb|.2f}"),
    ("bit/param/round", "{bits_per_param_per_round|.4f}"), ("ratio vs fp32", "{compression_ratio|x}"),
)
PAGE_TABLES["federated"] = Table("federated.json", _FEDERATED_COLUMNS, "results[*]")
PAGE_TABLES["federated-codecs"] = Table("federated-codecs.json", _FEDERATED_COLUMNS, "results[*]")

# --- accuracy.md: benchmarks/federated.py --suite accuracy (per-seed curves: item r is round r)
PAGE_TABLES["accuracy"] = Table("federated-accuracy.json", _FEDERATED_COLUMNS, "results[*]",
                                command="python benchmarks/federated.py --suite accuracy")
_ROUND = "mean(curves[*][{r}])"
PAGE_TABLES["accuracy/rounds"] = Table("federated-accuracy.json", (
    ("resnet", "{label}"),
    *((f"round {r}", "{" + _ROUND.format(r=r) + "|p} ({" + _ROUND.format(r=r)
       + " - mean($.results[case=resnet none].curves[*][" + str(r) + "])|pts})") for r in range(8, 13)),
), (
    Row("fp32 (`none`)", "results[case=resnet none]",
        cells={f"round {r}": "{" + _ROUND.format(r=r) + "|p}" for r in range(8, 13)}),
    Row("`sign`+EF", "results[case=resnet sign+EF]"),
    Row("`stc` 0.01+EF", "results[case=resnet stc 0.01+EF]"),
    Row("`stc` 0.01+EF bn-affine", "results[case=resnet stc 0.01+EF bn-affine]"),
    Row("`stc` 0.0025+EF", "results[case=resnet stc 0.0025+EF]"),
    Row("`stc` 0.0025+EF bn-affine", "results[case=resnet stc 0.0025+EF bn-affine]"),
), command="python benchmarks/federated.py --suite accuracy")
PAGE_TABLES["accuracy/density-1000"] = Table("federated-accuracy.json", (
    ("setting", "{label}"), ("accuracy, mean ± sd", "{final_accuracy|p} ± {sd(final_accuracy_per_seed)|p} %"),
    ("upload MB", "{upload_mb|.3f}"), ("ratio", "{compression_ratio|x}"),
), tuple(Row(label, f"results[case={case}]", bold=bold) for label, case, bold in (
    ("fp32 (`none`)", "cnn none", ()),
    ("plain (constant 1/1000, FedAvg)", "cnn stc 0.001+EF plain", ()),
    ("mc (DGC momentum correction 0.5)", "cnn stc 0.001+EF mc", ()),
    ("mc + avgm", "cnn stc 0.001+EF mc+avgm", ()),
    ("sched10 (FedAvg)", "cnn stc 0.001+EF sched10", ()),
    ("EF21 + sched10 (FedAvg)", "cnn stc 0.001+EF21 sched10", ()),
    ("sched10 + avgm", "cnn stc 0.001+EF sched10+avgm", ()),
    ("sched20 + avgm", "cnn stc 0.001+EF sched20+avgm", ()),
    ("sched20 + avgm0.7", "cnn stc 0.001+EF sched20+avgm0.7", ()),
    ("sched30 (FedAvg)", "cnn stc 0.001+EF sched30", ()),
    ("sched30 + avgm (the default)", "cnn stc 0.001+EF default", "*"),
)), command="python benchmarks/federated.py --suite accuracy")

# --- privacy.md: benchmarks/privacy.py, benchmarks/dp_sgd.py
PAGE_TABLES["privacy"] = Table("privacy.json", (
    ("run", "{case|str}"), ("accuracy at round {$.rounds|int}", "{final_accuracy|pct}"), ("epsilon", "{epsilon|.2f}"),
), "rows[*]")

# --- distributed-dp.md: benchmarks/distributed_dp.py (median over seeds, the range in brackets)
PAGE_TABLES["distributed-dp"] = Table("distributed_dp.json", (
    ("target epsilon", "{target-epsilon|.0f}", "---:"), ("configuration", "{label}"),
    ("z", "{noise-multiplier|.3f}", "---:"), ("noise std of the sum / C", "{sum-noise-std-over-clip|.3f}", "---:"),
    ("bits/param", "{bits-per-parameter|.1f}", "---:"),
    ("final accuracy, median ({len($.seeds)|int} seeds; range)",
     "{final-accuracy|pct} ({min(finals)|p}-{max(finals)|p})", "---:"),
), tuple(Row(label, f"rows[target-epsilon={eps};label={case}]", bold=bold)
         for eps in (50, 200) for label, case, bold in (
    ("central client-level DP, no SecAgg", "central client-level DP, no SecAgg", ()),
    ("central client-level DP under SecAgg+ (server adds the noise)",
     "central client-level DP under SecAgg+ (server noise)", ()),
    ("**distributed DP under SecAgg+** (clients' Skellam shares, c = {secagg-clipping-range|.2f})",
     "distributed DP under SecAgg+ (Skellam shares)", (5,)),
)))

# --- device-memory.md: benchmarks/device_memory.py (one row per model, codec and container), memory_share.py
PAGE_TABLES["device-memory"] = Table("device_memory.json", (
    ("model, codec", "`{model|str}`, {codec|str}"), ("container", "{memory|str}"),
    ("rounds", "{rounds-completed|int}/{rounds|int}"),
    ("ClientApp peak RSS (MiB, metrics.json)", "{client-peak-rss-mb|.0f}", "---:"),
    ("container peak, processes' own memory (MiB)", "{container-anon-peak-mb|.0f}", "---:"),
    ("container peak incl. page cache (MiB)", "{container-peak-mb|.0f}", "---:"),
    ("OOM kills in it", "{oom-kills|int}", "---:"),
), "rows[*]")
PAGE_TABLES["device-memory/share"] = Table("memory_share.json", (
    ("codec", "{codec|str}"), ("`residual-dtype`", "{residual-dtype|str}"),
    ("round peak (MiB)", "{peak-bytes / 1048576|.0f}", "---:"),
    ("fedcomp share (MiB)", "{share-bytes / 1048576|.0f}", "---:"),
    ("share / model", "{share-x-model|x2}", "---:"),
    ("residual held between rounds", "{residual-bytes / 1048576|.1f} MiB ({residual-x-model|x2})"),
), "rows[*]")

# --- scale.md: benchmarks/scale.py (server: one record per codec, clients and path; downstream: per round)
def _scale_rows() -> tuple[Row, ...]:
    rows = []
    for codec, label, payload in (("stc", "stc 1/400", "{payload_kib_per_client|.0f} KiB"),
                                  ("topk", "topk 0.01", "{payload_kib_per_client|.0f} KiB"),
                                  ("sign", "sign", "{payload_kib_per_client / 1024|.2f} MiB"),
                                  ("int8", "int8", "{payload_kib_per_client / 1024|.1f} MiB")):
        for n in (10, 100, 1000):
            dense = ({} if n == 10 else {"dense: time": "", "dense: peak": ""})
            rows.append(Row(f"{label} ({payload})" if n == 10 else "",
                            f"server[codec={codec};clients={n};path=streaming]", cells=dense))
    return tuple(rows)


_DENSE = "$.server[codec=<<codec>>;clients=<<clients>>;path=dense]"
PAGE_TABLES["scale/server"] = Table("scale.json", (
    ("codec (payload per client)", "{label}"), ("N", "{clients|int}"),
    ("streaming: time", "{seconds|.3g} s"), ("streaming: peak", "{peak_growth_x_model|x1}"),
    ("dense: time", "{" + _DENSE + ".seconds|.3g} s"), ("dense: peak", "{" + _DENSE + ".peak_growth_x_model|x1}"),
), _scale_rows(), command="python benchmarks/scale.py")
PAGE_TABLES["scale/downstream"] = Table("scale.json", (
    ("N", "{nodes|int}"), ("round", "{round|int}"), ("messages", "{kinds|counts}"),
    ("configure", "{configure_seconds|.2f} s"), ("peak", "{configure_peak_x_model|x1}"),
    ("aggregate", "{aggregate_seconds|.2f} s"), ("peak ", "{aggregate_peak_x_model|x1}"),
    ("resident (kept)", "{resident_x_model|x1} ({copies_kept|.0f})"),
    ("download per node", "{download_x_model_per_node|.3f}x ({download_kib_per_node / 1024|.1f} MiB)"),
), "downstream[*]", command="python benchmarks/scale.py --only-downstream")
_STEADY = "$.downstream_correction[?nodes=<<nodes>>;correction={c};round>=4]"
PAGE_TABLES["scale/correction"] = Table("scale.json", (
    ("N", "{nodes|int}"), ("aggregate, corrected", "{" + _STEADY.format(c=1) + ".aggregate_seconds|.1f-} s"),
    ("vs uncorrected (paired)", "{" + _STEADY.format(c=1) + ".aggregate_seconds_x_uncorrected|x1-}"),
    ("aggregate peak", "{" + _STEADY.format(c=1) + ".aggregate_peak_x_model|x1-}"),
    ("vs uncorrected", "+{" + _STEADY.format(c=1) + ".aggregate_peak_minus_uncorrected_x_model|x1-}"),
    ("configure peak (uncorrected)", "{" + _STEADY.format(c=1) + ".configure_peak_x_model|x1-} "
                                    "({" + _STEADY.format(c=0) + ".configure_peak_x_model|x1-})"),
), tuple(Row("", f"downstream_correction[nodes={n};correction=1;round=4]") for n in (100, 1000)),
    command="python benchmarks/scale.py --only-downstream --corrections 0,1")
PAGE_TABLES["scale/client"] = Table("scale.json", (
    ("codec", "{codec|str}"), ("`compress_update` / the codec alone", "{ratio_to_codec|x2}"),
    ("one `torch.sum` / the codec's own payloads", "{sum_over_default_codec|.3f}x"),
    ("peak RSS growth", "{peak_growth_x_model|x2}"),
), "client[*]", command="python benchmarks/scale.py --only-client")

# --- secagg.md: benchmarks/secagg.py (rows by label; int64 rows ran one round for their bytes)
_SAME = {"accuracy, round 50": "(same as packed)"}
PAGE_TABLES["secagg"] = Table("secagg.json", (
    ("configuration", "{label}"), ("bits/param", "{bits-per-parameter|.3f}", "---:"),
    ("accuracy, round 50", "{final-accuracy|pct}", "---:"),
), (
    Row("plain FedAvg, fp32, no SecAgg", "rows[label=plain FedAvg fp32 (no SecAgg, no compression)]"),
    Row("SecAgg+ dense as Flower ships it (int64)", "rows[label=SecAgg+ dense, Flower int64 (today)]", cells=_SAME),
    Row("SecAgg+ dense, packed ({modulus-bits|int}-bit modulus)", "rows[label=SecAgg+ dense, packed]"),
    Row("plain random-k d = 1/16, per-client positions, no SecAgg", "rows[label=plain randomk d=0.0625 (no SecAgg)]"),
    Row("SecAgg+ shared random-k d = 1/16, int64", "rows[label=SecAgg+ randomk d=0.0625, int64]", cells=_SAME),
    Row("SecAgg+ shared random-k d = 1/16, packed", "rows[label=SecAgg+ randomk d=0.0625, packed]"),
    Row("SecAgg+ shared random-k d = 1/16, packed + rotation",
        "rows[label=SecAgg+ randomk d=0.0625, packed + rotation]", bold=(2,)),
    Row("plain random-k d = 1/64, per-client positions, no SecAgg", "rows[label=plain randomk d=0.015625 (no SecAgg)]"),
    Row("SecAgg+ shared random-k d = 1/64, int64", "rows[label=SecAgg+ randomk d=0.015625, int64]", cells=_SAME),
    Row("SecAgg+ shared random-k d = 1/64, packed", "rows[label=SecAgg+ randomk d=0.015625, packed]"),
    Row("SecAgg+ shared random-k d = 1/64, packed + rotation",
        "rows[label=SecAgg+ randomk d=0.015625, packed + rotation]"),
    *(Row(label, f"secagg_density005.json:rows[label={case}]", bold=bold,
          cells={"accuracy, round 50": "{final-accuracy|pct} ({finals|p/})"})
      for label, case, bold in (
          ("plain random-k d = 0.05, no SecAgg (2 seeds)", "plain randomk d=0.05 (no SecAgg)", ()),
          ("SecAgg+ shared random-k d = 0.05, packed (2 seeds)", "SecAgg+ randomk d=0.05, packed", (1,)),
          ("SecAgg+ shared random-k d = 0.05, packed + rotation (2 seeds)",
           "SecAgg+ randomk d=0.05, packed + rotation", (1, 2)))),
), command=lambda name: {"secagg_density005.json": "python benchmarks/secagg.py --skip-dense --densities 0.05 "
                                                     "--seeds 42 43 --out benchmarks/results/secagg_density005.json"}
    .get(name, "python benchmarks/secagg.py"))
_PER_SEED_ACC = "{final-accuracy|pct} ({finals|p/})"
PAGE_TABLES["secagg/bits"] = Table("secagg_bits.json", (
    ("configuration", "{label}"), ("modulus bits", "{modulus-bits?|int}", "---:"),
    ("bits/param", "{bits-per-parameter|.3f}", "---:"),
    ("accuracy, round 50: median (per seed)", _PER_SEED_ACC, "---:"),
), tuple(Row(label, f"rows[label={case}]", bold=bold) for label, case, bold in (
    ("plain FedAvg, fp32, no SecAgg", "plain FedAvg fp32 (no SecAgg, no compression)", ()),
    ("SecAgg+ shared random-k d = 1/16, rotation, 16-bit, c = 1",
     "SecAgg+ randomk d=0.0625, 16-bit, c=1, packed + rotation", ()),
    ("SecAgg+ shared random-k d = 1/16, rotation, 8-bit, c = 0.05",
     "SecAgg+ randomk d=0.0625, 8-bit, c=0.05, packed + rotation", ()),
    ("SecAgg+ shared random-k d = 1/16, rotation, 4-bit, c = 0.05",
     "SecAgg+ randomk d=0.0625, 4-bit, c=0.05, packed + rotation", ()),
    ("**SecAgg+ shared random-k d = 1/16, rotation, 3-bit, c = 0.05**",
     "SecAgg+ randomk d=0.0625, 3-bit, c=0.05, packed + rotation", (2, 3)),
    ("SecAgg+ shared random-k d = 0.07, rotation, 3-bit, c = 0.05",
     "SecAgg+ randomk d=0.07, 3-bit, c=0.05, packed + rotation", ()),
    ("SecAgg+ shared random-k d = 1/16, rotation, 2-bit, c = 0.05",
     "SecAgg+ randomk d=0.0625, 2-bit, c=0.05, packed + rotation", ()),
    ("SecAgg+ shared random-k d = 0.095, rotation, 1-bit, c = 0.05",
     "SecAgg+ randomk d=0.095, 1-bit, c=0.05, packed + rotation", ()),
)))
_ONE_SEED_ACC = {"accuracy, round 50: median (per seed)": "{final-accuracy|pct} (one seed)"}
_FP32_BITS = "rows[label=plain FedAvg fp32 (no SecAgg, no compression)]"
PAGE_TABLES["secagg/server-step"] = Table("secagg_bits2.json", (
    ("configuration", "{label}"), ("modulus bits", "{modulus-bits?|int}", "---:"),
    ("bits/param", "{bits-per-parameter|.3f}", "---:"),
    ("accuracy, round 50: median (per seed)", _PER_SEED_ACC, "---:"),
    ("every 10 rounds (first seed)", "{accuracy-every-10-rounds[0]|p0,}"),
), (
    Row("plain FedAvg, fp32, no SecAgg (`secagg_bits.json`)", "secagg_bits.json:" + _FP32_BITS,
        cells={"every 10 rounds (first seed)": "{$." + _FP32_BITS + ".accuracy-every-10-rounds[0]|p0,}"}),
    *(Row(label, f"rows[label={case}]", bold=bold, cells=_ONE_SEED_ACC if one else {}) for label, case, bold, one in (
        ("d = 1/16, 3-bit, step 1",
         "SecAgg+ randomk d=0.0625, 3-bit, c=0.05, packed + rotation (the former secagg = true alone)", (), True),
        ("d = 1/16, 16-bit, c = 1, step 1", "SecAgg+ randomk d=0.0625, 16-bit, c=1, packed + rotation", (), True),
        ("d = 1/8, 3-bit, step 1", "SecAgg+ randomk d=0.125, 3-bit, c=0.05, packed + rotation", (), True),
        ("d = 1/4, 3-bit, step 1", "SecAgg+ randomk d=0.25, 3-bit, c=0.05, packed + rotation", (), True),
        ("d = 1/16, 3-bit, step 2",
         "SecAgg+ randomk d=0.0625, 3-bit, c=0.05, packed + rotation, server-lr 2", (), True),
        ("d = 1/16, 3-bit, step 4",
         "SecAgg+ randomk d=0.0625, 3-bit, c=0.05, packed + rotation, server-lr 4", (), False),
        ("d = 0.07, 3-bit, step 4", "SecAgg+ randomk d=0.07, 3-bit, c=0.05, packed + rotation, server-lr 4", (), False),
        ("**`secagg = true` alone: d = 0.07, 3-bit, c = 0.05, rotation, step 4**",
         "SecAgg+ secagg = true alone (now: d=0.07, 3-bit, c=0.05, rotation, server-lr 4)", (2, 3), False),
        ("d = 0.07, 3-bit, step 4 falling linearly to 1 at round 50 (`secagg-server-lr-decay`)",
         "SecAgg+ randomk d=0.07, 3-bit, c=0.05, packed + rotation, server-lr 4 falling to 1 "
         "(secagg-server-lr-decay)", (), False),
        ("d = 0.082, 2-bit, step 4",
         "SecAgg+ randomk d=0.082, 2-bit, c=0.05, packed + rotation, server-lr 4", (), False),
    )),
))

# --- links.md: benchmarks/links.py's own comparison (compare, link_floor) of each run in links.json
def _links_rows(data: dict) -> list[dict]:
    links = benchmark("links")
    out = []
    for row in data["rows"]:
        floor = links.link_floor(data["rows"], row["codec"])
        speed = "unshaped" if row["uplink-mbps"] is None else f"{row['uplink-mbps']:g} / {row['downlink-mbps']:g}"
        out.append({"codec": row["codec"],
                    "speed": speed + (f", RTT {row['rtt-ms']:g} ms" if row.get("rtt-ms") else ""),
                    "rtt-ms": row.get("rtt-ms"), "uplink-mbps": row["uplink-mbps"], "rounds": row["rounds-to-target"],
                    "floor": floor, **links.compare(row, floor)})
    return out


PAGE_TABLES["links"] = Table("links.json", (
    ("codec", "{codec|str}"), ("up / down Mbit/s", "{speed|str}"), ("rounds to 90 %", "{rounds|int}"),
    ("measured s", "{measured|.1f}", "---:"), ("computed s", "{computed|.1f}", "---:"),
    ("ratio", "{ratio|.2f}", "---:"), ("transfers-only model s", "{old|.1f}", "---:"),
    ("ratio to it", "{ratio-old|.2f}", "---:"),
    ("link part measured s", "{link-measured|.2f}", "---:"), ("link part computed s", "{link-computed|.2f}", "---:"),
    ("ratio link", "{ratio-link|.2f}", "---:"), ("poll wait s/round", "{overhead-per-round|.1f}", "---:"),
), _links_rows, command="sudo python benchmarks/links.py")

# --- codecs.md: benchmarks/codecs.py (sizes and errors; the throughput mode), decode_memory.py
PAGE_TABLES["codecs/gaussian"] = Table("codecs.json", (
    ("n", "{n|n,}", "---:"), ("codec", "{codec|str}"), ("settings", "{@|settings}"), ("bytes", "{bytes|n,}", "---:"),
    ("bit/param", "{bits_per_param|.4f}", "---:"), ("positions / bound", "{position_bits_over_bound?|.4f}", "---:"),
    ("rel. L2 error", "{compression_error|.3f}", "---:"),
), "rows[*]")
PAGE_TABLES["codecs/real-updates"] = Table("codecs.json", (
    ("codec", "{label}"), ("bit/param", "{[round=1].bits_per_param|.2f}"),
    ("rel. error round 1", "{[round=1].rel_l2_error|.3f}"), ("rel. error round 10", "{[round=10].rel_l2_error|.3f}"),
), tuple(Row(label, f"real_updates[?{sel}]", bold=bold) for label, sel, bold in (
    ("`sign`", "codec=sign", ()),
    ("`eden`", "codec=eden;unbiased=null", (2, 3)),
    ("`eden`, `unbiased = true`", "codec=eden;unbiased=true", ()),
    ("`qsgd` s = 7", "codec=qsgd;spacing=null", ()),
    ('`qsgd` s = 7, `spacing = "exponential"`', "codec=qsgd;spacing=exponential", ()),
    ("`powersgd` rank 1", "codec=powersgd;rank=1", ()),
    ("`powersgd` rank 4", "codec=powersgd;rank=4", ()),
    ("`int8`", "codec=int8", ()),
)))
PAGE_TABLES["codecs/throughput"] = Table("codecs_throughput.json", (
    ("codec", "{codec|str}"), ("settings", "{@|settings}"),
    ("encode / read pass", "{encode_vs_sum|.1f}", "---:"), ("decode / copy", "{decode_vs_clone|.2f}", "---:"),
    ("decode into a buffer / copy", "{decode_out_ms / $.clone_ms|.2f}", "---:"),
    ("target (enc / dec)", "{encode_target|.1f} / {decode_target|.1f}", "---:"),
    ("encode", "{met_if_at_most(encode_vs_sum, encode_target)|str}"),
    ("decode", "{met_if_at_most(decode_vs_clone, decode_target)|str}"),
), "rows[?codec!=none]", command="python benchmarks/codecs.py --throughput")
_FLOOR = {"floor of identical bytes": "-"}
PAGE_TABLES["codecs/floors"] = Table("codecs_throughput.json", (
    ("codec", "{label}"), ("encode / read pass", "{encode_vs_sum|.1f}", "---:"),
    ("target", "{encode_target|.1f}", "---:"), ("floor of identical bytes", "{floor_vs_sum?|.1f}", "---:"),
    ("the target is", ""),
), (
    Row("int8 (block 256)", "rows[codec=int8]", cells={"floor of identical bytes": "{floor_vs_sum|.1f} (the draws)",
        "the target is": "below the floor: unreachable with the same bytes"}),
    Row("qsgd (15 levels)", "rows[codec=qsgd]", cells={"floor of identical bytes": "{floor_vs_sum|.1f} (the draws)",
        "the target is": "below the floor: unreachable with the same bytes"}),
    Row("sign", "rows[codec=sign]", cells={"floor of identical bytes": "{floor_vs_sum|.1f} (abs + mean)",
        "the target is": "{encode_target - floor_vs_sum|.1f} read passes above the floor: packing the signs "
                         "would have to fit in that"}),
    Row("eden", "rows[codec=eden]", cells={**_FLOOR, "the target is": "needs a native butterfly kernel (the same "
                                                       "butterflies in the same order keep the bytes)"}),
    Row("stc 1 %", "rows[codec=stc;density=0.01]", cells={**_FLOOR, "the target is": "not met; see below"}),
    Row("stc 1/400", "rows[codec=stc;density=0.0025]", cells={**_FLOOR, "the target is": "not met; see below"}),
    Row("topk 1 %", "rows[codec=topk]", cells={**_FLOOR, "the target is": "not met; see below"}),
    Row("fp16", "rows[codec=fp16]",
        cells={**_FLOOR, "the target is": "{met_if_at_most(encode_vs_sum, encode_target)|str}"}),
    Row("bf16", "rows[codec=bf16]",
        cells={**_FLOOR, "the target is": "{met_if_at_most(encode_vs_sum, encode_target)|str}"}),
    Row("randomk 1 %", "rows[codec=randomk]",
        cells={**_FLOOR, "the target is": "{met_if_at_most(encode_vs_sum, encode_target)|str}"}),
), command="python benchmarks/codecs.py --throughput")
PAGE_TABLES["codecs/decode-memory"] = Table("decode_memory.json", (
    ("codec", "{codec|str}"), ("settings", "{params|settings}"), ("payload bytes", "{payload_bytes|n,}", "---:"),
    ("peak / decoded output", "{peak_over_output|x2}", "---:"),
), "rows[*]")

# --- ddp-hook.md: benchmarks/ddp_hook.py's runs (one per side and seed), means over the seeds
_DDP_SIDES = (("DDP (fp32 allreduce)", "ddp (fp32 allreduce)"), ("torch fp16 hook", "torch fp16 hook"),
              ("torch bf16 hook", "torch bf16 hook"), ("torch PowerSGD rank 1", "torch PowerSGD r1"),
              ("torch PowerSGD rank 4", "torch PowerSGD r4"), ("fedcomp sign", "fedcomp sign"),
              ("fedcomp STC, density 0.01", "fedcomp stc 0.01"), ("fedcomp top-k, density 0.01", "fedcomp topk 0.01"),
              ("fedcomp int8", "fedcomp int8"), ("fedcomp QSGD", "fedcomp qsgd"),
              ("fedcomp PowerSGD rank 4", "fedcomp powersgd r4"))
PAGE_TABLES["ddp-hook"] = Table("ddp_hook.json", (
    ("side", "{label}"), ("bytes/step/rank", "{mean([*].bytes_per_step) / 1000|.2f} kB", "---:"),
    ("ratio ({$.config.steps|int} steps)", "{mean([*].ratio)|x1}", "---:"),
    ("ratio per compressed step", "{mean([*].ratio_per_compressed_step)|x}", "---:"),
    ("encode+decode / compute", "{mean([*].encode_decode_ms) / mean([*].compute_ms)|pct0}", "---:"),
    ("final loss", "{mean([*].final_loss)|.3f}", "---:"),
    ("final accuracy, mean (per seed)", "{mean([*].final_accuracy)|pct} ({[*].final_accuracy|p;})"),
    ("replicas identical", "{yes_if_all([*].replicas_identical)|str}"),
), tuple(Row(label, f"runs[?side={side}]", cells={"encode+decode / compute": "-"} if side.startswith("ddp") else {})
         for label, side in _DDP_SIDES), command="python benchmarks/ddp_hook.py --seeds 0 1 2")

# --- ddp-hook.md: benchmarks/ddp_links.py's runs over shaped links (one per link, model and side)
_DDP_LINK_SIDES = tuple((label, side) for label, side in _DDP_SIDES if side != "torch fp16 hook")
_DDP_LINK_GPT = ("fedcomp int8", "fedcomp qsgd")  # sides the GPT leaves out


def _ddp_links(model: str, mbps: int) -> Table:
    """The sides of ``model`` over the ``mbps`` link: bytes, the step's time split, the quality and the
    time to DDP's final quality."""
    quality = ((("final accuracy", "{final_accuracy|pct}", "---:"), ("points below DDP", "{quality_gap|p}", "---:"))
               if model == "resnet" else
               (("final loss", "{final_loss|.3f}", "---:"), ("loss above DDP", "{quality_gap * 100|+.1f} %", "---:")))
    sides = [(label, side) for label, side in _DDP_LINK_SIDES if model == "resnet" or side not in _DDP_LINK_GPT]
    return Table("ddp_links.json", (
        ("side", "{label}"), ("bytes/step/rank", "{bytes_per_step / 1000|.1f} kB", "---:"),
        ("ratio", "{ratio|x1}", "---:"), ("interface sent/step", "{wire_bytes_per_step / 1000|.1f} kB", "---:"),
        ("ms/step: compute / enc+dec / comm", "{compute_ms|.0f} / {encode_decode_ms|.0f} / {comm_ms|.0f}", "---:"),
        ("enc+dec / compute", "{encode_decode_share|pct0}", "---:"), *quality,
        ("steps to DDP's final", "{steps_to_ddp_final|int}", "---:"),
        ("s to DDP's final", "{time_to_ddp_final_s|.1f}", "---:"),
        ("faster than torch PowerSGD", "{speedup_vs_powersgd|x2}", "---:"),
        ("s for DDP's steps", "{train_s|.0f}", "---:"),
    ), tuple(Row(label, f"runs[mbps={mbps};model={model};side={side}]") for label, side in sides))


PAGE_TABLES["ddp-links/resnet-100"] = _ddp_links("resnet", 100)
PAGE_TABLES["ddp-links/gpt-100"] = _ddp_links("gpt", 100)
PAGE_TABLES["ddp-links/resnet-1000"] = _ddp_links("resnet", 1000)

# --- diloco.md: benchmarks/diloco.py's runs (one per side)
_DILOCO_SIDES = (("ddp", 1, 1, "fp32 allreduce"), ("diloco-fp32", 10, 1, "none"), ("diloco-fp32", 50, 1, "none"),
                 ("diloco-int8", 50, 1, "int8 + EF"), ("diloco-sign", 50, 1, "sign + EF"),
                 ("diloco-stc", 50, 1, "stc density 0.01 + EF"), ("diloco-topk", 50, 1, "topk density 0.01 + EF"),
                 ("streaming-fp32", 50, 5, "none"))


def _diloco(file: str, outer: str) -> Table:
    return Table(file, (
        ("side", "{name|str}"), ("outer optimizer", outer), ("H", "{sync_every|int}", "---:"),
        ("F", "{fragments|int}", "---:"), ("codec (error feedback)", "{label}"),
        ("final held-out loss", "{final_loss|.3f}", "---:"), ("vs DDP", "{loss_gap_pct|+.1f} %", "---:"),
        ("MB sent per worker", "{bytes_per_worker / 1e6|.3f}", "---:"),
        ("fewer bytes than DDP", "{ratio_vs_ddp|x,}", "---:"),
        ("utilisation at 100 Mbps (computed)", "{utilisation_100mbps_computed|pct}", "---:"),
    ), tuple(Row(codec, f"runs[name={name};sync_every={h};fragments={f}]",
                 cells={"outer optimizer": "-"} if name == "ddp" else {}) for name, h, f, codec in _DILOCO_SIDES))


PAGE_TABLES["diloco/nesterov"] = _diloco(
    "diloco.json", "SGD lr {$.settings.outer_lr|str}, Nesterov {$.settings.outer_momentum|str}")
PAGE_TABLES["diloco/averaging"] = _diloco("diloco_averaging.json", "SGD lr {$.settings.outer_lr|.0f} (averaging)")

# --- llm.md: benchmarks/llm.py (full model: key "full"; LoRA: key "lora") and benchmarks/llm_lora.py's
# per-seed files (llm_lora[_KIND]_SEED.json, which record no command: it is rebuilt from what they hold)
def _lora_command(name: str) -> str:
    """The ``llm_lora.py`` command that writes ``name``: its seed, rounds, clients a round and cases."""
    if name == "llm.json":
        return "python benchmarks/llm.py --part lora"
    data = result(name)["lora"]
    fed, seed = data["federation"], re.search(r"_(\d+)\.json$", name).group(1)
    cases = " ".join(f"'{r['case']}'" for r in data["results"])
    per_round = f" --per-round {fed['per_round']}" if fed["per_round"] != 2 else ""
    return (f"python benchmarks/llm_lora.py --rounds {fed['rounds']} --seed {seed}{per_round} --cases {cases} "
            f"--out benchmarks/results/{name}")


_FULL = (("codec", "{case|str}"),
         ("next-char acc. (last / mean of last 3)", "{final_accuracy|pct} / {last3_accuracy|pct}"),
         ("vs fp32, same beta1 (points)", "{0 - points_below_fp32|+.1f}"),
         ("rounds to fp32 - 1 pt", "{rounds_to_target|int}"),
         ("upload MB", "{upload_mb|.3f}"), ("bit/param/round", "{bits_per_param_per_round|.4f}"),
         ("upload vs fp32", "{upload_reduction_vs_fp32|x}"), ("upload MB to 30 %", "{upload_mb_to[0.30]|.3g}"),
         ("upload MB to 35 %", "{upload_mb_to[0.35]|.3g}"))
PAGE_TABLES["llm/full"] = Table("llm.json", _FULL, "full.results[*]", command="python benchmarks/llm.py --part full")
_LORA_COLUMNS = (("case (up / down)", "{case|str} ({compressor|str} / {downstream|str})"),
                 ("eval-loss gain kept", "{gain_kept|pct0}"), ("bytes up", "{upload_bytes / 1000|.1f} kB"),
                 ("bytes down", "{download_bytes / 1000|.1f} kB"), ("total vs fp32", "{ratio_total|x}"),
                 ("bits/param up, down", "{bits_up|.3f}, {bits_down|.3f}"))
PAGE_TABLES["llm/lora"] = Table("llm.json", _LORA_COLUMNS, "lora.results[*]",
                                command="python benchmarks/llm.py --part lora")
PAGE_TABLES["llm/lora-study"] = Table("llm.json", _LORA_COLUMNS, "lora.study.results[*]",
                                      command="python benchmarks/llm.py --part lora")


def _per_seed(files: tuple[str, ...], path: str) -> str:
    return "list(" + ", ".join(f"{f}:{path}" for f in files) + ")"


_LORA_SEEDS = ("llm_lora_42.json", "llm_lora_43.json", "llm_lora_44.json")
_CORRECTION = ("llm_lora_correction_42.json", "llm_lora_correction_43.json", "llm_lora_correction_44.json")
_FRONTIER = ("llm_lora_frontier_42.json", "llm_lora_frontier_43.json", "llm_lora_frontier_44.json")


def _gain_columns(files: tuple[str, ...], extra: tuple) -> tuple:
    gain = _per_seed(files, "lora.results[case=<<case>>].gain_kept")
    return (("case (up / down)", "{label}"), ("gain kept (per seed)", "{" + gain + "|p/} %"),
            ("median", "{median(" + gain + ")|pct}"), *extra)


def _med(files: tuple[str, ...], field: str) -> str:
    return "median(" + _per_seed(files, "lora.results[case=<<case>>]." + field) + ")"


PAGE_TABLES["llm/lora-seeds"] = Table("llm_lora_42.json", _gain_columns(_LORA_SEEDS, (
    ("bytes up", "{" + _med(_LORA_SEEDS, "upload_bytes") + " / 1000|.1f} kB"),
    ("bytes down (median)", "{" + _med(_LORA_SEEDS, "download_bytes") + " / 1000|.1f} kB"),
    ("total vs fp32 (median)", "{" + _med(_LORA_SEEDS, "ratio_total") + "|x}"),
    ("bits/param up, down (median)",
     "{" + _med(_LORA_SEEDS, "bits_up") + "|.3f}, {" + _med(_LORA_SEEDS, "bits_down") + "|.3f}"),
)), (
    Row("fp32 (none / none)", "lora.results[case=fp32]"),
    Row("**sign+EF (sign / sign), the `lora` preset**", "lora.results[case=sign+EF]", bold=(2, 5)),
    Row("sign+EF, at most 8 copies kept for catch-ups", "lora.results[case=sign+EF, 8 copies]"),
    Row("sign+EF, exact catch-ups (missed payloads)", "lora.results[case=sign+EF, exact catch-ups]"),
    Row("sign up, int8 down", "lora.results[case=sign up, int8 down]"),
    Row("randsign 50 % up, sign down", "lora.results[case=randsign 50% up, sign down]"),
    Row("fp32, FFA-LoRA (lora_A frozen)", "lora.results[case=fp32 FFA-LoRA]"),
    Row("sign+EF, FFA-LoRA", "lora.results[case=sign+EF FFA-LoRA]"),
    Row("sign+EF up, dense down, FFA-LoRA", "lora.results[case=sign+EF FFA-LoRA, dense down]"),
), command=_lora_command)
_PRESET = {"gain kept (per seed)": "{" + _per_seed(_LORA_SEEDS, "lora.results[case=sign+EF].gain_kept") + "|p/} %",
           "median": "{median(" + _per_seed(_LORA_SEEDS, "lora.results[case=sign+EF].gain_kept") + ")|pct}"}
PAGE_TABLES["llm/lora-correction"] = Table("llm_lora_correction_42.json", _gain_columns(_CORRECTION, (
    ("total vs fp32 (median)", "{" + _med(_CORRECTION, "ratio_total") + "|x}"),
    ("bits/param up, down (median)",
     "{" + _med(_CORRECTION, "bits_up") + "|.3f}, {" + _med(_CORRECTION, "bits_down") + "|.3f}"),
)), (
    Row("sign+EF, the `lora` preset (table above)", "llm_lora_42.json:lora.results[case=sign+EF]", cells={
        **_PRESET,
        "total vs fp32 (median)": "{median(" + _per_seed(_LORA_SEEDS, "lora.results[case=sign+EF].ratio_total")
                                  + ")|x}",
        "bits/param up, down (median)": "{median(" + _per_seed(_LORA_SEEDS, "lora.results[case=sign+EF].bits_up")
                                        + ")|.3f}, "
                                        "{median(" + _per_seed(_LORA_SEEDS, "lora.results[case=sign+EF].bits_down")
                                        + ")|.3f}"}),
    Row("sign+EF, downstream correction", "lora.results[case=sign+EF, correction]"),
    Row("STC 5 % both ways (first table: one seed)", "llm.json:lora.results[case=stc 5%]", cells={
        "gain kept (per seed)": "{gain_kept|pct0} (diverges)", "median": "",
        "total vs fp32 (median)": "{ratio_total|x}", "bits/param up, down (median)": "{bits_up|.3f}, {bits_down|.3f}"}),
    Row("STC 5 % both ways, downstream correction", "lora.results[case=stc 5%, correction]"),
), command=_lora_command)
PAGE_TABLES["llm/lora-frontier"] = Table("llm_lora_frontier_42.json", _gain_columns(_FRONTIER, (
    ("bits/param up, down (median)",
     "{" + _med(_FRONTIER, "bits_up") + "|.3f}, {" + _med(_FRONTIER, "bits_down") + "|.3f}"),
)), tuple(Row(label, f"lora.results[case={case}]") for label, case in (
    ("STC 5 % up, fp32 down", "stc 5% up, dense down"), ("STC 10 % up, fp32 down", "stc 10% up, dense down"),
    ("fp32 up, STC 5 % down (diverges)", "fp32 up, stc 5% down"),
    ("fp32 up, STC 5 % down, downstream correction", "fp32 up, stc 5% down, correction"),
    ("fp32 up, STC 10 % down, downstream correction", "fp32 up, stc 10% down, correction"),
    ("fp32 up, randsign 50 % down", "fp32 up, randsign 50% down"),
    ("fp32 up, randsign 50 % down, downstream correction", "fp32 up, randsign 50% down, correction"),
    ("fp32 up, sign down (per tensor)", "fp32 up, sign down"),
)), command=_lora_command)
PAGE_TABLES["llm/lora-sampling"] = Table("llm_lora_4of8_42.json", (
    ("clients a round", "{label}"),
    ("STC 5 % both ways (total vs fp32)",
     "{lora.results[case=stc 5%].gain_kept|pct} ({lora.results[case=stc 5%].ratio_total|x})"),
    ("the same, downstream correction", "{lora.results[case=stc 5%, correction].gain_kept|pct}"),
    ("STC 10 % both ways (total vs fp32)",
     "{lora.results[case=stc 10%].gain_kept|pct} ({lora.results[case=stc 10%].ratio_total|x})"),
), (
    Row("{lora.federation.per_round|int} of {lora.federation.clients|int}", "@"),
    Row("{lora.federation.per_round|int} of {lora.federation.clients|int} (every client every round)",
        "llm_lora_8of8_42.json:@"),
), command=_lora_command)
PAGE_TABLES["llm/projection"] = Table("llm.json", (
    ("FlowerTune general-NLP run (13.63M adapter parameters, 2 clients x 2 directions x 200 rounds)", "{codec|str}"),
    ("GiB", "{gib|.3g}", "---:"), ("x fewer", "{ratio|x}", "---:"),
), "lora.projection[*]", command="python benchmarks/llm.py --part lora")

# --- both-ways.md: benchmarks/both_ways.py's summaries (medians over seeds per case) and runs (per seed)
_FP32 = "$.summary[case=fp32 both ways]"
_VS_FP32 = "{final_accuracy - $.summary[case=fp32 both ways].final_accuracy|pts}"
_DOWN = "{download_bytes / 1e6|.3f} ({first_download_bytes / 1e6|.3f})"
_PER_SEED = "{$.runs[?case=<<case>>].final_accuracy|p/}"
PAGE_TABLES["both-ways/cnn"] = Table("both_ways.json", (
    ("case", "{label}"), ("final acc. (median)", "{final_accuracy|pct}"), ("vs fp32", _VS_FP32),
    ("upload MB", "{upload_bytes / 1e6|.3f}"), ("download MB (first model)", _DOWN),
    ("ratio up", "{ratio_upload|x}"), ("ratio both ways", "{ratio_both_ways|x}"),
), (
    Row("fp32 both ways", "summary[case=fp32 both ways]"),
    Row('dense download (`downstream = "none"`)', "summary[case=default upload, dense download]"),
    Row("STC 5 % down, dense first model", "summary[case=default upload, dense first model]"),
    Row("**the default: STC 5 % down, seeded start**", "summary[case=default (stc 5 % down, seeded start)]",
        bold=("final acc. (median)", "vs fp32", "ratio both ways")),
    Row("STC 3 % down", "summary[case=stc 3 % down]"),
    Row("STC 2 % down", "summary[case=stc 2 % down]"),
    Row("STC 1 % down", "summary[case=stc 1 % down]"),
    Row("STC 10 % down", "summary[case=stc 10 % down]"),
    Row("sign down, one scale per tensor", "summary[case=sign down]"),
    Row("STC 5 % down, int8 start (a third-party app's default)", "summary[case=int8 start, stc 5 % down]"),
    Row('default with `downstream-correction = "on"`', "summary[case=default, downstream correction on]"),
))
_RESNET8 = (
    ("case", "{label}"), ("round 8 (median)", "{final_accuracy|pct}"), ("vs fp32", _VS_FP32),
    ("last 3", "{last3_accuracy|pct}"), ("upload MB", "{upload_bytes / 1e6|.3f}"),
    ("download MB (first model)", _DOWN), ("ratio both ways", "{ratio_both_ways|x}"),
)
PAGE_TABLES["both-ways/resnet"] = Table("both_ways_resnet.json", _RESNET8, (
    Row("fp32 both ways", "summary[case=fp32 both ways]"),
    Row("**sign up, auto down (STC 5 %)**", "summary[case=sign up, auto down]",
        bold=("round 8 (median)", "vs fp32", "ratio both ways")),
    Row("**STC 1 % up, auto down (STC 5 %)**", "summary[case=stc 1 % up, auto down]",
        bold=("round 8 (median)", "vs fp32", "ratio both ways")),
    Row("sign up, dense download", "summary[case=sign up, dense download]"),
    Row("STC 1 % up, dense download", "summary[case=stc 1 % up, dense download]"),
    Row("fp32 up, STC 5 % down", "summary[case=fp32 up, auto's stc 5 % down]"),
    Row("STC 1 % up, auto down, dense first model", "summary[case=stc 1 % up, auto down, dense first model]"),
    Row("STC 1 % up, **density ramp** 25 % → 1 % over 5 rounds", "summary[case=stc 1 % up, auto down, ramp]"),
    Row("STC 1 % up, STC 20 % down", "summary[case=stc 1 % up, stc 20 % down]"),
    Row("STC 1 % up, BatchNorm affine sent dense", "summary[case=stc 1 % up, auto down, bn-affine]"),
    Row("STC 1 % up, server momentum 0.5 (FedAvgM)", "summary[case=stc 1 % up, auto down, avgm]"),
    Row("sign up, server momentum 0.5", "summary[case=sign up, auto down, avgm]"),
))
_TARGET = "median($.runs[?case=fp32 both ways].final_accuracy) - 0.01"
_RUNS = "$.runs[?case=<<case>>]"
PAGE_TABLES["both-ways/resnet-30"] = Table("both_ways_resnet_30r.json", (
    ("case", "{label}"), ("round 30 (median)", "{final_accuracy|pct}"), ("last 3", "{last3_accuracy|pct}"),
    ("bytes both ways, 30 rounds", "{(upload_bytes + download_bytes) / 1e6|.2f} MB"),
    ("ratio both ways", "{ratio_both_ways|x}"),
    ("round reaching {" + _TARGET + "|pct} (per seed)",
     "{reach_each(" + _RUNS + ".accuracy_curve, " + _TARGET + ")|int,}"),
    ("MB to {" + _TARGET + "|pct}", "{bytes_to_fp32_minus_1pt / 1e6|.2f}"),
    ("ratio to {" + _TARGET + "|pct}", "{ratio_to_fp32_minus_1pt|x}"),
), (
    Row("fp32 both ways", "summary[case=fp32 both ways]"),
    Row("sign up, auto down", "summary[case=sign up, auto down]"),
    Row("**STC 1 % up, auto down**", "summary[case=stc 1 % up, auto down]", bold=(1, 7)),
    Row("STC 1 % up, density ramp over 5 rounds", "summary[case=stc 1 % up, auto down, ramp]"),
    Row("STC 1 % up, STC 2 % down", "summary[case=stc 1 % up, stc 2 % down]"),
))
_BYTES_TO = "bytes_to_each(" + _RUNS + ".accuracy_curve, " + _RUNS + ".bytes_both_ways_curve, " + _TARGET + ")"
_T20 = (
    ("case", "{label}"), ("round 20 (per seed)", _PER_SEED + " %"), ("median", "{final_accuracy|pct}"),
    ("vs fp32", _VS_FP32), ("upload MB", "{upload_bytes / 1e6|.3f}"), ("download MB (first model)", _DOWN),
    ("ratio both ways", "{ratio_both_ways|x}"),
)
_ONE_SEED = {"round 20 (per seed)": "{final_accuracy|pct} (first seed only)", "median": "",
             "vs fp32": "{final_accuracy - $.runs[case=fp32 both ways;seed=<<seeds>>].final_accuracy|pts} on that seed"}
PAGE_TABLES["both-ways/transformer"] = Table("both_ways_transformer.json", _T20, (
    Row("fp32 both ways", "summary[case=fp32 both ways]"),
    Row("**STC 4 % up, auto down (STC 5 %), downstream correction (the default)**",
        "summary[case=stc 4 % up, auto down]", bold=("median", "vs fp32", "ratio both ways")),
    Row('the same without the correction (`downstream-correction = "off"`)',
        "summary[case=stc 4 % up, auto down, no correction]"),
    Row("STC 4 % up, dense download", "summary[case=stc 4 % up, dense download]"),
    Row("STC 5 % up, STC 4 % down, correction", "summary[case=stc 5 % up, stc 4 % down]", cells=_ONE_SEED),
    Row("STC 6 % up, STC 3 % down, correction", "summary[case=stc 6 % up, stc 3 % down]", cells=_ONE_SEED),
    Row("STC 3 % up, STC 8 % down, correction", "summary[case=stc 3 % up, stc 8 % down]", cells=_ONE_SEED),
))
_BUDGET = "($.summary[case=fp32 both ways].upload_bytes + $.summary[case=fp32 both ways].download_bytes) / 100"
_PAIRED = ("{final_accuracy - $.summary[case=fp32 both ways].final_accuracy|pts} "
           "({$.runs[?case=<<case>>].final_accuracy - $.runs[?case=fp32 both ways].final_accuracy|pts/})")
PAGE_TABLES["both-ways/transformer-alone"] = Table("both_ways_transformer.json", (
    ("case", "{label}"), ("round 20 (per seed)", _PER_SEED + " %"), ("median", "{final_accuracy|pct}"),
    ("vs fp32, median (paired per seed)", _PAIRED), ("upload MB", "{upload_bytes / 1e6|.3f}"),
    ("download MB", "{download_bytes / 1e6|.3f}"),
    ("share of the {" + _BUDGET + " / 1e6|.1f} MB", "{upload_bytes / (" + _BUDGET + ")|pct0} (upload)"),
), (
    Row("STC 4 % up, dense download", "summary[case=stc 4 % up, dense download]"),
    Row("STC 8 % up, dense download", "summary[case=stc 8 % up, dense download]"),
    Row("STC 16 % up, dense download", "summary[case=stc 16 % up, dense download]"),
    Row("fp32 up, STC 5 % down (correction on)", "summary[case=fp32 up, stc 5 % down]",
        cells={"share of the {" + _BUDGET + " / 1e6|.1f} MB": "{download_bytes / (" + _BUDGET + ")|pct0} (download)"}),
))
_BEST = "max_each(" + _RUNS + ".accuracy_curve)"
_BEST_AT = "argmax_each(" + _RUNS + ".accuracy_curve)"
PAGE_TABLES["both-ways/transformer-60"] = Table("both_ways_transformer_60r.json", (
    ("case, 60 rounds", "{label}"), ("round 60 (per seed)", _PER_SEED + " %"), ("median", "{final_accuracy|pct}"),
    ("vs fp32", _VS_FP32),
    ("best round, median (rounds per seed)", "{median(" + _BEST + ")|pct} ({" + _BEST_AT + "|int,})"),
    ("upload MB", "{upload_bytes / 1e6|.3f}"), ("download MB", "{download_bytes / 1e6|.3f}"),
    ("ratio both ways", "{ratio_both_ways|x}"), ("ratio to fp32's final - 1 point", "{ratio_to_fp32_minus_1pt|x}"),
), (
    Row("fp32 both ways", "summary[case=fp32 both ways]"),
    Row("**STC 4 % up, auto down, downstream correction (the default)**", "summary[case=stc 4 % up, auto down]",
        bold=("median", "vs fp32", "ratio both ways")),
    Row("the same without the correction", "summary[case=stc 4 % up, auto down, no correction]"),
))
_LEVERS = (("case", "{label}"), ("round 20", "{final_accuracy|pct}"), ("vs fp32", _VS_FP32),
           ("last 3", "{last3_accuracy|pct}"), ("ratio both ways", "{ratio_both_ways|x}"))
PAGE_TABLES["both-ways/levers"] = Table("both_ways_transformer_levers.json", _LEVERS, (
    Row("fp32 both ways", "summary[case=fp32 both ways]"),
    Row("STC 4 % up, auto down (STC 5 %)", "summary[case=stc 4 % up, auto down, no correction]"),
    Row("STC 4 % up, dense download", "summary[case=stc 4 % up, dense download]"),
    Row("STC 4 % up, int8 down", "summary[case=stc 4 % up, int8 down]"),
    Row("STC 4 % up, sign down (per tensor, 1 bit)", "summary[case=stc 4 % up, sign down]"),
    Row("STC 4 % up, auto down, dense first model", "summary[case=stc 4 % up, auto down, dense first model]"),
    Row("STC 4 % up, auto down, per tensor both ways", "summary[case=stc 4 % up, auto down, per tensor]"),
    Row("STC 4 % up, auto down, density ramp 25 % -> 4 % over 5 rounds", "summary[case=stc 4 % up, auto down, ramp]"),
    Row("STC 4 % up, auto down, server momentum 0.5 (FedAvgM)", "summary[case=stc 4 % up, auto down, avgm]"),
    Row("STC 2 % up, STC 10 % down", "summary[case=stc 2 % up, stc 10 % down]"),
    Row("STC 6 % up, STC 3 % down", "summary[case=stc 6 % up, stc 3 % down, no correction]"),
    Row("STC 4 % up, top-k 1 % down", "summary[case=stc 4 % up, top-k 1 % down]"),
    Row("randsign 25 % up, auto down", "summary[case=randsign 25 % up, auto down]"),
    Row("STC 4 % up, randsign 30 % down", "summary[case=stc 4 % up, randsign 30 % down]"),
    Row("randsign 25 % up, randsign 25 % down", "summary[case=randsign 25 % up, randsign 25 % down]"),
    Row("STC 4 % up, auto down, **with the correction** (`both_ways_transformer.json`, the same seed)",
        "both_ways_transformer.json:runs[case=stc 4 % up, auto down;seed=3]",
        cells={"last 3": "{mean_last_each(both_ways_transformer.json:runs[?case=stc 4 % up, auto down;seed=3]"
                         ".accuracy_curve, 3)|pct/}",
               "ratio both ways": "{both_ways_transformer.json:summary[case=stc 4 % up, auto down]"
                                  ".ratio_both_ways|x}"}),
))


def on_page_markdown(markdown: str, page, config, files) -> str:  # MkDocs' hook signature
    """Replace the markers described in the module docstring."""
    markdown = RUN_CONFIG.sub(lambda m: run_config_reference(), markdown)
    markdown = CODEC_REF.sub(lambda m: codec_reference(), markdown)
    markdown = INCLUDE.sub(lambda m: (REPO / m.group("path")).read_text(), markdown)
    markdown = TABLE.sub(lambda m: results_table(m.group("name")), markdown)
    markdown = SPEC_TABLE.sub(lambda m: spec_table(m.group("id")), markdown)
    markdown = VALUE.sub(lambda m: value_marker(m.group("spec")), markdown)
    return RESULTS.sub(lambda m: results_line(m.group("names")), markdown)
