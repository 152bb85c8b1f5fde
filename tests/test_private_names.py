"""No module of ``fedcomp`` uses another module's private names (``_name``): what two modules
share is public where it belongs. Checked on the source with :mod:`ast`, nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fedcomp"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(current: str, is_package: bool, level: int, module: str | None) -> str:
    """The module a ``from ... import`` reads from, as a dotted name."""
    if level == 0:
        return module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _defined_privates(tree: ast.AST) -> set[str]:
    """Private names a file defines: functions, classes, assignments, ``self._x = ...`` attributes."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return {n for n in out if _private(n)}


def private_uses(package: Path = PACKAGE) -> list[str]:
    """Every place a file of ``package`` reaches a private name of another of its files:
    ``from fedcomp.x import _y``, ``x._y`` on an imported fedcomp module, and ``obj._y`` where
    ``_y`` is defined in another fedcomp file and not in this one (a private attribute of an object
    built elsewhere). ``self``/``cls``/``super()`` access is the owner's own. One line a finding."""
    files = {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    trees = {name: ast.parse(p.read_text(encoding="utf-8"), str(p)) for name, p in files.items()}
    defined = {name: _defined_privates(tree) for name, tree in trees.items()}
    everywhere = set().union(*defined.values())
    found = []
    for name, tree in trees.items():
        where = files[name].relative_to(package.parent)
        modules = {}  # local name -> fedcomp module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                src = _absolute(name, files[name].name == "__init__.py", node.level, node.module)
                for alias in node.names:
                    if f"{src}.{alias.name}" in files:
                        modules[alias.asname or alias.name] = f"{src}.{alias.name}"
                    if _private(alias.name) and src != name:
                        found.append(f"{where}:{node.lineno}: from {src} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in files and alias.asname:
                        modules[alias.asname] = alias.name
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if isinstance(owner, ast.Name) and owner.id in modules:
                if modules[owner.id] != name:
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)} ({modules[owner.id]})")
            elif node.attr in everywhere and node.attr not in defined[name]:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_uses_another_modules_private_names():
    assert private_uses() == []


def test_the_check_finds_each_kind_of_private_use(tmp_path):
    pkg = tmp_path / "fedcomp"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "owner.py").write_text(
        "def _helper():\n    pass\n\nclass Box:\n    def __init__(self):\n        self._inside = 1\n"
        "    def __repr__(self):\n        return str(self._inside)\n")
    (pkg / "user.py").write_text(
        "from .sub.owner import _helper\nfrom .sub import owner\nfrom .sub.owner import Box\n\n"
        "def f(box: Box):\n    owner._helper()\n    return box._inside, box.__class__, super\n")
    assert private_uses(pkg) == [
        "fedcomp/user.py:1: from fedcomp.sub.owner import _helper",
        "fedcomp/user.py:6: owner._helper (fedcomp.sub.owner)",
        "fedcomp/user.py:7: box._inside",
    ]
