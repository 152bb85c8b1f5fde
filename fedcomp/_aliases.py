"""The module paths of fedcomp 0.1's first layout, kept importable.

Apps and scripts written against the old layout name modules such as ``fedcomp.server.app`` (a
``pyproject.toml`` component: ``serverapp = "fedcomp.server.app:app"``), ``fedcomp.client.app`` or
``fedcomp.training``. A finder on ``sys.meta_path`` answers each old name with the module that now
holds its code: the same module object, so ``fedcomp.server.app.app is fedcomp.app.server_app.app``.
This is a table, not an import: no package of fedcomp imports another through it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import importlib.machinery
import sys
from types import ModuleType

#: old module path -> the module that holds its code now
OLD_PATHS: dict[str, str] = {
    "fedcomp.files": "fedcomp.util.files",
    "fedcomp.validate": "fedcomp.util.validate",
    "fedcomp.extras": "fedcomp.util.extras",
    "fedcomp._opacus": "fedcomp.privacy.opacus_import",
    "fedcomp.broadcast": "fedcomp.protocol.broadcast",
    "fedcomp.seeded_init": "fedcomp.protocol.seeded_init",
    "fedcomp.device": "fedcomp.protocol.device",
    "fedcomp.low_density": "fedcomp.config.low_density",
    "fedcomp.model_policy": "fedcomp.config.model_policy",
    "fedcomp.secagg.config": "fedcomp.config.secagg",
    "fedcomp.data": "fedcomp.task.data",
    "fedcomp.datafiles": "fedcomp.task.datafiles",
    "fedcomp.text_data": "fedcomp.task.text_data",
    "fedcomp.models": "fedcomp.task.models",
    "fedcomp.lm": "fedcomp.task.lm",
    "fedcomp.lora": "fedcomp.task.lora",
    "fedcomp.objective": "fedcomp.task.objective",
    "fedcomp.training": "fedcomp.task.training",
    "fedcomp.client.dp_sgd": "fedcomp.privacy.dp_sgd",
    "fedcomp.client.app": "fedcomp.app.client_app",
    "fedcomp.client.lora": "fedcomp.app.lora_client_app",
    "fedcomp.client.legacy": "fedcomp.client.numpy_client",
    "fedcomp.client.downstream": "fedcomp.client.downstream_receiver",
    "fedcomp.server": "fedcomp.app",
    "fedcomp.server.app": "fedcomp.app.server_app",
    "fedcomp.server.checkpoint": "fedcomp.app.checkpoint",
    "fedcomp.server.results": "fedcomp.app.results",
    "fedcomp.server.console": "fedcomp.app.console",
    "fedcomp.server.startup": "fedcomp.app.startup",
    "fedcomp.server.strategy_record": "fedcomp.app.strategy_record",
    "fedcomp.secagg.server_app": "fedcomp.app.secagg_server_app",
    "fedcomp.strategies.legacy": "fedcomp.strategies.legacy_strategy",
    "fedcomp.strategies.downstream": "fedcomp.strategies.downstream_sender",
    "fedcomp.strategies.ef21": "fedcomp.strategies.ef21_aggregate",
    "fedcomp.strategies.privacy": "fedcomp.strategies.privacy_budget",
    "fedcomp.statedict.exact": "fedcomp.statedict.integer_rule",
    "fedcomp.simulate": "fedcomp.run.simulation",
    "fedcomp.simulation": "fedcomp.run.inprocess_grid",
    "fedcomp.deploy": "fedcomp.run.local_deployment",
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module now holding its code (imported under its new name)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was executed once, under its new name."""

    def get_code(self, fullname: str):
        """The new module's code, for ``python -m <old path>`` (``runpy`` runs it as ``__main__``)."""
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)


class _OldPathFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = OLD_PATHS.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new), is_package=fullname == "fedcomp.server")


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(f, _OldPathFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPathFinder())
