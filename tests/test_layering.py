"""The package layering rule: imports point down only, package to package, with no cycle.

Every ``import`` of a fedcomp module, lazy ones inside functions included, is read from the source
(``ast``). A package may import itself and the packages of lower layers; packages of one layer do
not import each other (the server side, ``strategies``, never reaches ``client``). The reference app
(``task``, ``app``, ``run``) sits above every package of the library: the library never imports it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fedcomp"

#: bottom to top
LAYERS = [
    ["util"],
    ["compression", "statedict"],
    ["protocol", "distributed"],  # distributed: compression and util only, never Flower
    ["privacy"],
    ["config"],
    ["download"],  # the server-to-client model: both sides of it, below the mod and the strategy
    ["client", "strategies"],
    ["secagg"],
    # the reference app, above the whole library
    ["task"],
    ["app"],
    ["run"],
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
#: The reference app built on the library: what a node computes, the Flower apps, their launchers.
DEMO = ("task", "app", "run")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_by_module(root: Path = PACKAGE) -> dict[str, set[str]]:
    """``{"fedcomp.x.y": {"fedcomp.a.b", ...}}`` for every module under ``root``."""
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        name = _module_name(path, root)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target == "fedcomp":  # from fedcomp import x: x is the module imported
                    targets.update(f"fedcomp.{a.name}" for a in node.names)
                elif target.startswith("fedcomp."):
                    targets.add(target)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("fedcomp."))
        found[name] = targets
    return found


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def upward_imports(found: dict[str, set[str]]) -> list[str]:
    """Every ``module -> target`` that does not point to the module's own package or a lower layer."""
    wrong = []
    for module, targets in sorted(found.items()):
        src = _package(module)
        if src not in LAYER_OF:  # fedcomp/__init__.py
            continue
        for target in sorted(targets):
            dst = _package(target)
            if dst == src:
                continue
            if dst not in LAYER_OF or LAYER_OF[dst] >= LAYER_OF[src]:
                wrong.append(f"{module} -> {target}")
    return wrong


def package_cycles(found: dict[str, set[str]]) -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in found.items():
        graph.setdefault(_package(module), set()).update(
            _package(t) for t in targets if _package(t) != _package(module))
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    return [c for n in sorted(graph) if n not in state and (c := visit(n, []))]


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYER_OF)


def test_at_most_six_loose_modules_at_the_top():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py"]


def test_imports_point_down_only():
    assert upward_imports(imports_by_module()) == []


def test_no_cycle_between_packages():
    assert package_cycles(imports_by_module()) == []


def test_the_rule_sees_a_lazy_upward_import_and_a_cycle(tmp_path):
    fake = tmp_path / "fedcomp"
    for pkg, body in {"compression": "def f():\n    from fedcomp.app import server_app\n",
                      "app": "from fedcomp.compression import wire\n"}.items():
        (fake / pkg).mkdir(parents=True)
        (fake / pkg / "__init__.py").write_text(body)
    found = imports_by_module(fake)
    assert found == {"fedcomp.compression": {"fedcomp.app"}, "fedcomp.app": {"fedcomp.compression"}}
    assert upward_imports(found) == ["fedcomp.compression -> fedcomp.app"]
    assert package_cycles(found) == [["app", "compression", "app"]]


def test_the_server_app_imports_no_client_module():
    code = ("import sys, fedcomp.app.server_app, fedcomp.strategies\n"
            "print(sorted(m for m in sys.modules if m.startswith('fedcomp.client')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_reference_app_sits_above_every_library_package():
    library = [pkg for pkg in LAYER_OF if pkg not in DEMO]
    assert min(LAYER_OF[pkg] for pkg in DEMO) > max(LAYER_OF[pkg] for pkg in library)
    found = imports_by_module()
    assert sorted(f"{m} -> {t}" for m, targets in found.items() if _package(m) in library
                  for t in targets if _package(t) in DEMO) == []


def test_the_library_loads_no_module_of_the_reference_app():
    code = ("import sys, fedcomp.strategies, fedcomp.client\n"
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['fedcomp', 'task'], ['fedcomp', 'app'],"
            " ['fedcomp', 'run'])))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
