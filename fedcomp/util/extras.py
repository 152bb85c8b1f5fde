"""The optional dependency groups (pyproject ``[project.optional-dependencies]``) and one import
helper that says which group a missing module belongs to.

The core install (``pip install fedcomp``) is what a SuperNode needs: Flower without its simulation
extra, numpy and torch. Everything else is imported only on the path that needs it, through
:func:`require`, so that a core-only device gets a clear "install fedcomp[<extra>]" instead of a
bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: top-level module -> the extra that installs it
EXTRA_OF = {
    "flwr_datasets": "data",
    "datasets": "data",
    "sklearn": "data",
    "matplotlib": "plots",
    "opacus": "dp",
    "ray": "simulation",
    "transformers": "llm",
    "peft": "llm",
}


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` (dotted names allowed) or explain which extra provides it.

    Parameters
    ----------
    module : str
        Module to import, e.g. ``"sklearn.datasets"``.
    purpose : str
        What needs it, for the message (e.g. ``"the default digits data"``).

    Returns
    -------
    module
        The imported module.

    Raises
    ------
    ModuleNotFoundError
        The module's distribution is not installed; the message names ``pip install 'fedcomp[<extra>]'``.
        A missing module that is not the requested one (a broken install) is re-raised unchanged.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if exc.name is None or exc.name.split(".")[0] != top:
            raise
        extra = EXTRA_OF.get(top, "dev")
        raise ModuleNotFoundError(
            f"{purpose} needs {top!r}, which the core install leaves out: pip install 'fedcomp[{extra}]'",
            name=exc.name) from None
