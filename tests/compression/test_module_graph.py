"""The module graph inside ``fedcomp/compression/``: no import cycle at module level, and codecs never
import the registry (it finds them; they do not register themselves) nor the decoding of payloads.

Imports are read from the source with ``ast``: module-level ones (inside ``if``/``try`` blocks and class
bodies too) for the cycle rule, every one (lazy ones inside functions included) for the registry rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fedcomp.compression as fc
from fedcomp.compression.dense import SMALL_TENSOR, SMALL_TENSOR_CODECS

PACKAGE = Path(fc.__file__).resolve().parent
REGISTRY = "fedcomp.compression.registry"
#: What no codec module imports: the registry, and the decoding that asks it for codecs.
ABOVE_CODECS = {REGISTRY, "fedcomp.compression.decoding"}


def _name(path: Path, root: Path) -> str:
    stem = [] if path.stem == "__init__" else [path.stem]
    return ".".join(["fedcomp", root.name, *stem])


def _targets(node: ast.AST, module: str, is_package: bool, submodules: set[str]) -> set[str]:
    """The modules of the package one import statement names."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    package = module if is_package else module.rpartition(".")[0]
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    named = {f"{base}.{a.name}" for a in node.names}
    return (named & submodules) | ({base} if named - submodules else set())


def _module_level(body: list[ast.stmt]):
    """Import statements run when the module is imported (not those inside functions)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    yield from _module_level([n for n in inner if isinstance(n, ast.AST)])


def import_graph(root: Path = PACKAGE, lazy: bool = False) -> dict[str, set[str]]:
    """``{module: {module of the package it imports, ...}}``; ``lazy``: imports inside functions too."""
    files = {_name(p, root): p for p in sorted(root.glob("*.py"))}
    inside = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = ([n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] if lazy
                 else list(_module_level(tree.body)))
        targets: set[str] = set()
        for node in nodes:
            targets |= _targets(node, module, path.stem == "__init__", inside)
        graph[module] = {t for t in targets if t in inside and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected start found by depth-first search (empty: none)."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else path + [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    return [c for n in sorted(graph) if n not in state and (c := visit(n, [n]))]


def test_no_import_cycle_at_module_level_inside_compression():
    assert cycles(import_graph()) == []


def test_no_codec_module_imports_the_registry_or_the_decoding_even_lazily():
    codec_modules = {cls.__module__ for cls in fc.CODECS.values()}
    graph = import_graph(lazy=True)
    assert codec_modules and codec_modules <= set(graph)
    assert sorted(f"{m} -> {t}" for m in codec_modules for t in graph[m] & ABOVE_CODECS) == []


def test_the_rules_see_a_cycle_and_a_lazy_import(tmp_path):
    fake = tmp_path / "compression"
    fake.mkdir()
    (fake / "__init__.py").write_text("from fedcomp.compression.base import A\n")
    (fake / "base.py").write_text("from fedcomp.compression import options\n")
    (fake / "options.py").write_text("if True:\n    from .registry import B\n")
    (fake / "registry.py").write_text("from fedcomp.compression.base import A\n")
    (fake / "stc.py").write_text("def f():\n    from fedcomp.compression import registry\n")
    graph = import_graph(fake)
    assert graph["fedcomp.compression.stc"] == set()
    assert import_graph(fake, lazy=True)["fedcomp.compression.stc"] == {REGISTRY}
    assert cycles(graph) == [["fedcomp.compression.base", "fedcomp.compression.options", REGISTRY,
                              "fedcomp.compression.base"]]


def test_small_tensor_codecs_are_the_codecs_with_the_trait():
    assert tuple(SMALL_TENSOR_CODECS) == fc.codecs_with(small_tensor=True) == SMALL_TENSOR.choice_values()
