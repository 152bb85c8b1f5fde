"""Print fedcomp's requirements for a Docker image, one per line: the core (``[project].dependencies``
of pyproject.toml) plus the given extras, with fedcomp's own extras expanded (``fedcomp[data,plots]``)
and Flower's ``simulation`` extra (Ray) dropped, because SuperLink, SuperNodes and the ``flwr`` CLI
never start the simulation engine.

Usage: ``python3 scripts/image_requirements.py pyproject.toml [EXTRA,...] > requirements.txt``
(Python 3.11+). ``supernode`` image: no extras; full image: ``data,plots,dp``.
"""

import re
import sys
import tomllib


def _drop_simulation(dep: str) -> str | None:
    m = re.match(r"^(flwr)\[([^\]]*)\](.*)$", dep)
    if not m:
        return dep
    extras = [e.strip() for e in m.group(2).split(",") if e.strip() and e.strip() != "simulation"]
    return m.group(1) + (f"[{','.join(extras)}]" if extras else "") + m.group(3)


def image_requirements(pyproject: str, extras: tuple[str, ...] = ()) -> list[str]:
    """Requirement strings of the core and ``extras`` (self-references expanded, no ``simulation``).

    Raises
    ------
    KeyError
        An extra that pyproject.toml does not define.
    """
    with open(pyproject, "rb") as fh:
        project = tomllib.load(fh)["project"]
    name, optional = project["name"], project.get("optional-dependencies", {})
    out: list[str] = []
    todo, seen = list(extras), set()
    deps = list(project["dependencies"])
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        for dep in optional[extra]:
            m = re.match(rf"^{re.escape(name)}\[([^\]]*)\]$", dep)
            if m:
                todo.extend(e.strip() for e in m.group(1).split(",") if e.strip())
            else:
                deps.append(dep)
    for dep in deps:
        dep = _drop_simulation(dep)
        if dep not in out:
            out.append(dep)
    return out


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml"
    chosen = tuple(e for e in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if e)
    print("\n".join(image_requirements(path, chosen)))
