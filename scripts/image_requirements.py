"""Print fedcomp's runtime dependencies (``[project].dependencies`` of pyproject.toml), one per
line, for the Docker image: Flower's ``simulation`` extra (Ray) is dropped, because SuperLink,
SuperNodes and the ``flwr`` CLI never start the simulation engine.

Usage: ``python3 scripts/image_requirements.py pyproject.toml > requirements.txt`` (Python 3.11+).
"""

import re
import sys

import tomllib


def image_requirements(pyproject: str) -> list[str]:
    """Requirement strings of ``pyproject`` with ``simulation`` removed from flwr's extras."""
    with open(pyproject, "rb") as fh:
        deps = tomllib.load(fh)["project"]["dependencies"]
    out = []
    for dep in deps:
        m = re.match(r"^(flwr)\[([^\]]*)\](.*)$", dep)
        if m:
            extras = [e.strip() for e in m.group(2).split(",") if e.strip() and e.strip() != "simulation"]
            dep = m.group(1) + (f"[{','.join(extras)}]" if extras else "") + m.group(3)
        out.append(dep)
    return out


if __name__ == "__main__":
    print("\n".join(image_requirements(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")))
