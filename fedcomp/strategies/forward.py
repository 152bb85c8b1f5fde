"""Settings of a wrapped strategy stay reachable through the wrapper.

``CompressedStrategy(FedAvgM(...))`` is the object a ServerApp holds; without forwarding,
``strategy.server_learning_rate = 0.5`` would land on the wrapper and never reach FedAvgM,
silently. `ForwardsToInner` forwards reads of attributes the wrapper does not have, and
writes of public attributes the wrapper does not have but a wrapped strategy does, to the
strategy that owns them (walking ``.inner`` / ``.strategy``, so Flower's DP wrappers in between
are seen through). A public write that neither the wrapper nor any wrapped strategy knows is
refused with an ``AttributeError`` that names the closest known setting, the wrapper's constructor
arguments included (a misspelt setting must not vanish either; set on ``.inner`` it would vanish there).
Private names (``_x``) are the wrapper's own and never forwarded.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from fedcomp.strategies.wrapping import chain


def owner_of(strategy: Any, name: str) -> Any | None:
    """The first strategy in ``strategy``'s wrapping chain (`wrapping.chain`) that has
    attribute ``name``; None if none has."""
    return next((s for s in chain(strategy) if hasattr(s, name)), None)


class ForwardsToInner:
    """Mixin of strategy wrappers: attribute reads and writes meant for the wrapped strategy reach it.

    The subclass holds its wrapped strategy in ``inner`` (``_INNER``), may say how error messages
    name it (``_INNER_NAMED``) and calls `_start_forwarding` at the end of ``__init__`` (attributes set before that are
    the wrapper's own).

    Raises
    ------
    AttributeError
        Reading a name neither the wrapper nor a wrapped strategy has; writing a public name
        neither has (the message names the closest known setting).
    """

    _INNER = "inner"
    #: How error messages name the wrapped strategy's attribute.
    _INNER_NAMED = ".inner"
    #: Settings that belong to one of the wrapper's concerns: name -> where it is set (named when written).
    _SETTING_HINTS: dict[str, str] = {}

    def _start_forwarding(self) -> None:
        object.__setattr__(self, "_forwarding", True)

    def __getattr__(self, name: str) -> Any:  # only called when ordinary lookup fails
        d = self.__dict__
        inner = d.get(self._INNER)
        if name.startswith("__") or name == self._INNER or inner is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        owner = owner_of(inner, name)
        if owner is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}', nor has its wrapped "
                                 f"strategy {type(inner).__name__} ({self._INNER_NAMED})")
        return getattr(owner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        if not d.get("_forwarding") or name.startswith("_") or name in d or hasattr(type(self), name):
            object.__setattr__(self, name, value)
            return
        inner = d.get(self._INNER)
        owner = owner_of(inner, name)
        if owner is None and name in self._SETTING_HINTS:
            raise AttributeError(f"{type(self).__name__} has no setting '{name}': it is a setting of one of its "
                                 f"concerns, given at construction as {self._SETTING_HINTS[name]}")
        if owner is None:
            raise AttributeError(
                f"{type(self).__name__} has no setting '{name}', nor has its wrapped strategy "
                f"{type(inner).__name__} ({self._INNER_NAMED}). {self._closest(name)}Check the name: set on "
                f"{self._INNER_NAMED}, a name its strategy does not have would be ignored there")
        setattr(owner, name, value)

    def _closest(self, name: str) -> str:
        """``"Did you mean ...? "`` naming the closest public setting of the wrapper (its constructor
        arguments included) or of a wrapped strategy, or "" if none is close."""
        own = {k for k in inspect.signature(type(self).__init__).parameters if k not in ("self", "params")}
        own |= {k for k in (*vars(self), *dir(type(self))) if not k.startswith("_")}
        known = {k: "" for k in own}
        for s in chain(self.__dict__.get(self._INNER)):
            known.update({k: type(s).__name__ for k in vars(s) if not k.startswith("_") and k not in known})
        match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
        if not match:
            return ""
        m = match[0]
        if known[m]:
            return f"Did you mean '{m}' (of {known[m]}; set on the wrapper, it reaches it)? "
        if m in vars(self) or hasattr(type(self), m):
            return f"Did you mean '{m}' ({type(self).__name__}'s own)? "
        return f"Did you mean '{m}', an argument of {type(self).__name__}(...) (pass it when constructing)? "


__all__ = ["ForwardsToInner", "owner_of"]
