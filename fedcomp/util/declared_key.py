"""The declaration of one run-config key: name, type, default, allowed values and a one-line help.

Each key is declared once, beside the settings it fills (the codec's in `fedcomp.config.codec`,
the privacy ones in `fedcomp.privacy.settings`, the reference app's in `fedcomp.app.keys`, the
LoRA ones in `fedcomp.task.lora`); `fedcomp.config.keys` gathers the library's and
`fedcomp.app.keys` every key of the app into the registry that checks for unknown keys, holds
``pyproject.toml``'s defaults to account and renders the reference table. The type
lives here, at the bottom of the layering, so that every layer can declare its own keys.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from fedcomp.util.validate import read_bool, read_number, read_string


@dataclass(frozen=True)
class Key:
    """One run-config key.

    Attributes
    ----------
    name : str
        The kebab-case key, as written in ``[tool.flwr.app.config]`` (``"num-server-rounds"``).
    type : type
        ``bool``, ``int``, ``float`` or ``str``: what `read` returns.
    default : Any
        The value when the key is absent; also the value ``pyproject.toml`` must hold.
    help : str
        One line for the reference table.
    lo, hi : float, optional
        Bounds of a number (None: unbounded on that side).
    lo_open, hi_open : bool
        Exclude the bound itself.
    choices : tuple of str, or a callable returning the allowed strings, optional
        The allowed strings (a callable is asked when the key is read, so that it may name codecs
        registered later).
    rule : str
        The allowed values in words, for keys whose rule the bounds and choices cannot state (an
        integer or a fraction, a comma-separated list, 0 meaning "not set"). Such a key is read
        raw by `read` and checked by the settings class that owns it.
    """

    name: str
    type: type
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[str, ...] | Callable[[], Collection[str]] | None = None
    rule: str = ""

    @property
    def field(self) -> str:
        """The snake_case name of the dataclass field this key fills (``num_server_rounds``)."""
        return self.name.replace("-", "_")

    def read(self, cfg: Mapping[str, Any], src: str = "run config") -> Any:
        """``cfg[name]`` (the default when absent), checked for type, bounds and choices.

        Raises
        ------
        ValueError
            The `fedcomp.util.validate` messages: ``"run config 'lr' must be in (0.0, inf],
            got -1.0"``, ``"... must be one of [...]"``, ``"... must be true or false"``.
        """
        if self.rule:
            return cfg.get(self.name, self.default)
        if self.type is bool:
            return read_bool(cfg, self.name, self.default, src)
        if self.type is str:
            return read_string(cfg, self.name, self.default, self.choice_values(), src)
        return read_number(cfg, self.name, self.default, lo=self.lo, hi=self.hi, lo_open=self.lo_open,
                           hi_open=self.hi_open, integer=self.type is int, src=src)

    def choice_values(self) -> Collection[str] | None:
        """The allowed strings (``choices``, called if callable); None when any string goes."""
        return self.choices() if callable(self.choices) else self.choices

    def allowed(self) -> str:
        """The allowed values in words: ``"(0, 1]"``, ``"integer >= 1"``, ``"one of: a, b"``."""
        if self.rule:
            return self.rule
        if self.choices is not None:
            return "one of: " + ", ".join(f"`{c}`" for c in self.choice_values())
        if self.type is bool:
            return "true, false"
        if self.type is str:
            return "any string"
        kind = "integer" if self.type is int else "number"
        lo, hi = _text(self.lo), _text(self.hi)
        if self.lo is None and self.hi is None:
            return kind
        if self.hi is None:
            return f"{kind} {'>' if self.lo_open else '>='} {lo}"
        if self.lo is None:
            return f"{kind} {'<' if self.hi_open else '<='} {hi}"
        return f"{kind} in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"


def _text(x: float | None) -> str:
    return "" if x is None else str(x) if isinstance(x, int) else f"{x:g}"


def table(*keys: Key) -> dict[str, Key]:
    """``{name: key}`` in declaration order.

    Raises
    ------
    ValueError
        A name declared twice.
    """
    out: dict[str, Key] = {}
    for k in keys:
        if k.name in out:
            raise ValueError(f"run-config key {k.name!r} is declared twice")
        out[k.name] = k
    return out


def defaults(keys: Mapping[str, Key]) -> dict[str, Any]:
    """``{name: default}`` of a table (what ``pyproject.toml`` holds for these keys)."""
    return {name: k.default for name, k in keys.items()}


__all__ = ["Key", "defaults", "table"]
