"""Which run-config keys the library reads, gathered from the one declaration of each
(`fedcomp.util.declared_key.Key`), the refusal of any other key (naming the closest valid one,
so that a misspelt key is not silently ignored) and the reference table of keys.

The declarations: the codec keys of `fedcomp.config.codec.CODEC_KEYS`,
`fedcomp.privacy.settings.DP_KEYS` and `fedcomp.config.secagg.SECAGG_KEYS`. An app adds its
own groups to these (fedcomp's reference app: `fedcomp.app.keys`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedcomp.config.codec import CODEC_KEYS
from fedcomp.config.secagg import SECAGG_KEYS
from fedcomp.privacy.settings import DP_KEYS
from fedcomp.util.declared_key import Key, table
from fedcomp.util.validate import closest_hint


def _codec_keys() -> dict[str, Key]:
    """The codec keys (`fedcomp.config.codec.CODEC_KEYS`): the codec policy keys as
    `POLICY_KEYS` declares them, and each codec option as its codec
    declares it (``Compressor.options``)."""
    return dict(CODEC_KEYS)


#: Every run-config key the library declares, by group, in the reference table's order.
GROUPS: dict[str, dict[str, Key]] = {"codec": _codec_keys(), "dp": DP_KEYS, "secagg": SECAGG_KEYS}
#: ``{name: Key}`` of every run-config key of the library (a name declared in two groups is refused at import).
KEYS: dict[str, Key] = table(*(k for group in GROUPS.values() for k in group.values()))


def run_config_keys() -> frozenset[str]:
    """Every run-config key the library knows (the names of `KEYS`)."""
    return frozenset(KEYS)


def check_known_keys(cfg: Mapping[str, Any], known: frozenset[str] | None = None, source: str = "run config") -> None:
    """Refuse keys not in ``known``, naming the closest valid one (a misspelt ``densty = 0.05``
    would otherwise be ignored silently and the default used).

    Parameters
    ----------
    cfg : Mapping[str, Any]
        A run config (``context.run_config``, or the overrides of ``--run-config``).
    known : frozenset[str], optional
        The valid keys; default `run_config_keys` (an app passes its own, e.g.
        `fedcomp.app.keys.run_config_keys`).
    source : str
        What ``cfg`` is, for the message.

    Raises
    ------
    ValueError
        ``run config key 'densty' is unknown; did you mean 'density'?`` (for the first unknown key in
        sorted order; the closest name by ``difflib`` similarity >= 0.6, else no suggestion).
    """
    known = run_config_keys() if known is None else known
    unknown = sorted(k for k in cfg if k not in known)
    if unknown:
        raise ValueError(unknown_key_message(unknown[0], known, source))


def unknown_key_message(key: str, known, source: str = "run config") -> str:
    """``"run config key 'densty' is unknown; did you mean 'density'?"`` (one line)."""
    return (f"{source} key '{key}' is unknown; {closest_hint(key, known)} (every key, with its default, is in "
            "[tool.flwr.app.config] of pyproject.toml)")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def reference_table(keys: Mapping[str, Key] | None = None) -> str:
    """The markdown reference of run-config keys: one row per key (key, type, default, allowed
    values, help), grouped as `GROUPS`, defaults written as in ``pyproject.toml``.

    Parameters
    ----------
    keys : Mapping[str, Key], optional
        The keys to list; default every key (`KEYS`).

    Returns
    -------
    str
        A header row, a separator row and one row per key, ``\\n``-separated; ``|`` in a help text
        is escaped.
    """
    keys = KEYS if keys is None else keys
    rows = ["| key | type | default | allowed | help |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{k.name}` | {k.type.__name__} | `{_toml(k.default)}` | {k.allowed()} | "
             + k.help.replace("|", "\\|") + " |" for k in keys.values()]
    return "\n".join(rows)


__all__ = ["GROUPS", "KEYS", "check_known_keys", "reference_table", "run_config_keys",
           "unknown_key_message"]
