"""Opacus, imported without its module-level ``logging.basicConfig``.

``opacus/utils/module_utils.py`` (Opacus 1.5-1.6) calls ``logging.basicConfig(stream=sys.stderr)``
when it is imported, and every ``import opacus...`` reaches it through ``opacus/__init__.py``
(``from . import utils``), the accountants included. That gives the root logger a handler, so
every record of Flower's ``flwr`` logger (which propagates) prints twice, its DEBUG records too.
`import_opacus` imports the package while the root logger holds a placeholder handler,
which makes that ``basicConfig`` a no-op; every fedcomp module calls it before its first
``from opacus ... import``.
"""

from __future__ import annotations

import logging
import sys
import threading
from types import ModuleType

from fedcomp.util.extras import require

_LOCK = threading.Lock()


def import_opacus() -> ModuleType:
    """Import (once) and return the ``opacus`` package, leaving the root logger's handlers as they were.

    Returns
    -------
    module
        ``opacus``. Later ``from opacus.x import y`` statements find it in ``sys.modules`` and
        do not run ``basicConfig`` again.

    Raises
    ------
    ModuleNotFoundError
        Opacus is not installed (the core install leaves it out); the message names ``fedcomp[dp]``.
    """
    with _LOCK:
        if "opacus" in sys.modules:
            return sys.modules["opacus"]
        root = logging.getLogger()
        placeholder = logging.NullHandler()
        root.addHandler(placeholder)  # basicConfig does nothing while the root logger has a handler
        try:
            opacus = require("opacus", "differential privacy (dp-sgd, and the epsilon of client-level/local)")
        finally:
            root.removeHandler(placeholder)
        return opacus
