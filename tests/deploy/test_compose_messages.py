"""What the Docker Compose tests say when the engine cannot build (not ~4,000 characters of
build log per test): one line naming what is missing; and no machine path to the engine script."""

import pathlib

from .helpers import BASE_IMAGE, build_failure, engine_script

BASE_MISSING = """#1 [internal] load build definition from Dockerfile
#2 [internal] load metadata for docker.io/library/python:3.11-slim
#2 ERROR: failed to resolve source metadata for docker.io/library/python:3.11-slim: pull access denied
failed to solve: python:3.11-slim: failed to resolve source metadata
"""
NO_WHEEL = """#9 [build 3/5] RUN pip install /wheels/torch-*.whl || pip install torch==2.13.0
#9 3.2 ERROR: Could not find a version that satisfies the requirement torch==2.13.0 (from versions: none)
#9 3.2 ERROR: No matching distribution found for torch==2.13.0
"""


def test_a_missing_base_image_or_wheel_is_named_in_one_line():
    line = build_failure(BASE_MISSING)
    assert f"the base image {BASE_IMAGE} is missing" in line and "docker-engine.sh start" in line
    assert "no torch 2.13.0 wheel" in build_failure(NO_WHEEL)
    other = build_failure("#5 step 1\n#5 ERROR: process \"/bin/sh -c false\" did not complete\nend\n")
    assert other == '#5 ERROR: process "/bin/sh -c false" did not complete'
    assert all("\n" not in build_failure(x) for x in (BASE_MISSING, NO_WHEEL, ""))


def test_the_engine_script_is_found_by_env_var_or_next_to_the_repository(tmp_path, monkeypatch):
    script = tmp_path / "engine.sh"
    script.write_text("#!/bin/sh\n")
    monkeypatch.setenv("FEDCOMP_DOCKER_ENGINE", str(script))
    assert engine_script() == script
    monkeypatch.delenv("FEDCOMP_DOCKER_ENGINE")
    found = engine_script()
    repo = pathlib.Path(__file__).resolve().parents[2]
    assert found is None or found == repo.parent / "shared" / "tools" / "docker-engine.sh"


def test_no_machine_paths_in_the_readme_the_docs_or_the_tests():
    repo = pathlib.Path(__file__).resolve().parents[2]
    texts = {p: p.read_text() for p in [repo / "README.md", repo / "mkdocs.yml", *sorted((repo / "docs").rglob("*.md")),
                                        *sorted((repo / "tests").rglob("*.py"))]}
    for prefix in ("/" + "work/", "/" + "root/", "/" + "home/"):
        assert not [str(p.relative_to(repo)) for p, t in texts.items() if prefix in t], prefix
