"""The optional dependency groups (pyproject ``[project.optional-dependencies]``) and one import
helper that says which group a missing module belongs to.

The core install (``pip install .`` in a fedcomp checkout, or a wheel built from it) is what a
SuperNode needs: Flower without its simulation extra, numpy and torch. Everything else is imported
only on the path that needs it, through `require`, so that a core-only device gets a clear
"install fedcomp[<extra>]" instead of a bare ``ModuleNotFoundError``. fedcomp is not on the Python
package index, so every such message says how to install an extra from a checkout, a wheel or a git
URL (`install_hint`).
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


def install_hint(extra: str) -> str:
    """How to install fedcomp with ``extra``, in words that work without a package index entry.

    Parameters
    ----------
    extra : str
        An extra of ``[project.optional-dependencies]``, e.g. ``"plots"``.

    Returns
    -------
    str
        ``pip install -e '.[plots]'`` in a fedcomp checkout, or
        ``pip install 'fedcomp[plots] @ <wheel file or git URL of fedcomp>'`` (one line).
    """
    return (f"pip install -e '.[{extra}]' in a fedcomp checkout, or "
            f"pip install 'fedcomp[{extra}] @ <wheel file or git URL of fedcomp>'")


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
        The module's distribution is not installed; the message says how to install the extra
        (`install_hint`).
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
            f"{purpose} needs {top!r}, which the core install leaves out: {install_hint(extra)}",
            name=exc.name) from None
