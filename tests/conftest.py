"""Fixtures shared by the test packages. Plain helper functions live in modules: ``tests/messages.py``
(hand-built Flower messages), ``tests/flwr_run.py`` (`flwr run` on a private SuperLink),
``tests/model_zoo.py`` (small models with every kind of state_dict entry) and ``tests/<dir>/helpers.py``."""

import importlib
import pathlib
import random
import sys

import pytest
from flwr.app import Context, RecordDict

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _results_never_land_in_the_users_home(tmp_path_factory, monkeypatch):
    """A run that names no ``results-dir`` writes under ``$FEDCOMP_RESULTS_ROOT`` (default
    ``~/fedcomp-results``, the user's own folder, with its ``latest`` link): in tests that is a
    temporary folder, so the test suite never adds runs to (or repoints ``latest`` in) the user's."""
    monkeypatch.setenv("FEDCOMP_RESULTS_ROOT", str(tmp_path_factory.mktemp("results-root")))


@pytest.fixture(autouse=True)
def _same_python_random_state_in_every_test():
    """Flower samples nodes with Python's global ``random`` (``random.sample`` in its strategies): every
    test starts from ``random.seed(0)``, so which nodes a round samples does not depend on which tests
    ran before (CI once drew an order in which a partial-participation test saw no in-sync client;
    1 draw in 16 does). The state is put back afterwards."""
    state = random.getstate()
    random.seed(0)
    yield
    random.setstate(state)


@pytest.fixture
def run_server_app():
    """Run fedcomp's ServerApp on a fresh in-process grid: ``run_server_app(run_config, nodes=2)``
    (fresh SuperNodes, so an empty ``context.state``, as after a restart)."""
    from fedcomp.app.client_app import app as client_app
    from fedcomp.app.server_app import main
    from fedcomp.run.inprocess_grid import InProcessGrid

    def run(run_config: dict, nodes: int = 2) -> None:
        ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config)
        main(InProcessGrid(client_app, nodes, run_config), ctx)

    return run


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """FEDCOMP_DATA_DIR pointing at a small local corpus; fedcomp's data caches cleared before and after."""
    from fedcomp.task import data, text_data
    from tests.lm.helpers import write_corpus

    def clear():
        text_data.shakespeare_roles.cache_clear()
        data.load_partition.cache_clear()
        data.load_test_set.cache_clear()

    write_corpus(tmp_path / "cache")
    monkeypatch.setenv(text_data.CACHE_ENV, str(tmp_path / "cache"))
    clear()
    yield tmp_path / "cache"
    clear()


@pytest.fixture
def import_example(monkeypatch):
    """``import_example(folder, package)``: the ``client_app``, ``server_app`` and ``task`` modules of the app in
    ``examples/<folder>`` (package ``package``) by name; the package leaves ``sys.modules`` afterwards."""
    packages = []

    def load(folder: str, package: str) -> dict:
        monkeypatch.syspath_prepend(str(REPO / "examples" / folder))
        packages.append(package)
        return {name: importlib.import_module(f"{package}.{name}") for name in ("client_app", "server_app", "task")}

    yield load
    for package in packages:
        for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
            del sys.modules[name]


@pytest.fixture(scope="session")
def byte_base_dir(tmp_path_factory):
    """A tiny byte-level Llama (vocab 256, 80 positions) for the Shakespeare windows, saved with
    save_pretrained (no download): its folder."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=80, tie_word_embeddings=False)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("byte-base")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return str(out)
