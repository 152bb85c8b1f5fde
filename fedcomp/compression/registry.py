"""Which codecs exist: the registry (name and codec id -> class), how a codec gets into it, the
factory ([`get_compressor`][fedcomp.compression.get_compressor]), which codecs have a trait, and every option they read
from a run config.

Every [`Compressor`][fedcomp.compression.Compressor] subclass defined in a module of this package
(one with a name and a codec id) is a codec: `discover` imports every module of the package
and registers the codecs it finds, so a new codec file needs no edit elsewhere. Codec modules do
not import this module; a codec defined outside the package registers with `register`.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from types import ModuleType

from fedcomp.compression.base import Compressor
from fedcomp.compression.options import Option, merge_options
from fedcomp.util.validate import closest_hint

#: name -> Compressor subclass
CODECS: dict[str, type[Compressor]] = {}
#: codec id -> Compressor subclass (used by ``decompress``)
_BY_ID: dict[int, type[Compressor]] = {}
#: Traits `codecs_with` answers for (class attributes of ``Compressor``).
TRAITS = ("sparse", "per_tensor_only", "secagg", "density_ramp", "seeded", "small_tensor", "requires_error_feedback")


def register(cls: type[Compressor]) -> type[Compressor]:
    """Add a codec to the registry under ``cls.name`` and ``cls.codec_id`` (and set its
    ``config_keys`` from its ``options``); registering the same class again does nothing.

    Usable as a class decorator for a codec defined outside this package.

    Raises
    ------
    ValueError
        If the name or id is already taken by another class, or the class has no name or id.
    """
    if not (isinstance(cls, type) and issubclass(cls, Compressor)) or not cls.name or cls.codec_id < 0:
        raise ValueError(f"{cls!r} is not a codec: a Compressor subclass with a name and a codec id >= 0")
    if CODECS.get(cls.name) is cls and _BY_ID.get(cls.codec_id) is cls:
        return cls
    if cls.name in CODECS or cls.codec_id in _BY_ID:
        raise ValueError(f"codec {cls.name!r} / id {cls.codec_id} registered twice")
    cls.config_keys = {opt.arg: opt.key for opt in cls.options}
    CODECS[cls.name] = cls
    _BY_ID[cls.codec_id] = cls
    return cls


def _codecs_of(module: ModuleType) -> list[type[Compressor]]:
    """The codecs ``module`` defines (not those it imports), by codec id."""
    found = [obj for obj in vars(module).values()
             if isinstance(obj, type) and issubclass(obj, Compressor) and obj.__module__ == module.__name__
             and obj.name and obj.codec_id >= 0]
    return sorted(found, key=lambda c: c.codec_id)


def discover() -> None:
    """Import every module of ``fedcomp.compression`` and register the codecs each defines."""
    package = sys.modules[__package__]
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        for cls in _codecs_of(importlib.import_module(f"{__package__}.{info.name}")):
            register(cls)


def codec_by_id(codec_id: int) -> type[Compressor] | None:
    """The registered codec with this id, or None."""
    return _BY_ID.get(codec_id)


def get_compressor(name: str, **params) -> Compressor:
    """Build a registered codec by name.

    Parameters
    ----------
    name : str
        One of ``available_compressors()``: "none", "fp16", "bf16", "sign", "stc",
        "topk", "randomk", "qsgd", "int8", "powersgd", "eden".
    **params
        Codec parameters (``density``, ``levels``, ``block_size``, ``seed``,
        ``value_dtype``, ``rescale``, ``spacing``, ``rank``, ``unbiased``); see each
        codec's docstring.

    Returns
    -------
    Compressor

    Raises
    ------
    ValueError
        Unknown codec name; a parameter out of its range; a parameter the codec does not take:
        ``compressor 'stc' has no parameter 'densty'; did you mean 'density'? (its parameters: ['density'])``.
    """
    if name not in CODECS:
        raise ValueError(f"unknown compressor {name!r}; choose one of {sorted(CODECS)}")
    accepted = codec_parameters(name)
    for key in sorted(params):
        if key not in accepted and not accepted:
            raise ValueError(f"compressor {name!r} takes no parameters, got {key!r}")
        if key not in accepted:
            raise ValueError(f"compressor {name!r} has no parameter {key!r}; "
                             f"{closest_hint(key, accepted, 'parameter')} (its parameters: {sorted(accepted)})")
    return CODECS[name](**params)


def codec_parameters(name: str) -> frozenset[str]:
    """The keyword parameters the registered codec ``name`` takes (``frozenset()`` for "sign")."""
    signature = inspect.signature(CODECS[name])
    return frozenset(p.name for p in signature.parameters.values()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def available_compressors() -> list[str]:
    """Names accepted by [`get_compressor`][fedcomp.compression.get_compressor], sorted."""
    return sorted(CODECS)



def codecs_with(**traits: bool) -> tuple[str, ...]:
    """Names of the registered codecs whose traits have the given truth values, by codec id.

    Parameters
    ----------
    **traits : bool
        Trait name (one of `TRAITS`) -> wanted truth value: ``codecs_with(sparse=True)``
        gives ``("stc", "topk", "randomk")``.

    Raises
    ------
    ValueError
        An unknown trait name.
    """
    unknown = sorted(set(traits) - set(TRAITS))
    if unknown:
        raise ValueError(f"unknown codec trait(s) {unknown}; known: {list(TRAITS)}")
    chosen = [cls for cls in CODECS.values() if all(bool(getattr(cls, t)) == bool(v) for t, v in traits.items())]
    return tuple(cls.name for cls in sorted(chosen, key=lambda c: c.codec_id))


def codec_options() -> dict[str, Option]:
    """Every registered codec's options by run-config key (codecs by id, options in declared order).

    Raises
    ------
    ValueError
        Two codecs declare one key differently.
    """
    return merge_options({cls.name: cls.options for cls in sorted(CODECS.values(), key=lambda c: c.codec_id)})


__all__ = ["CODECS", "TRAITS", "available_compressors", "codec_by_id", "codec_options", "codec_parameters",
           "codecs_with", "discover", "get_compressor", "register"]
