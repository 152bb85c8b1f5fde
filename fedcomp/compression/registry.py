"""What the registered codecs are: which have a trait, and every option they read from a run config.

A codec module in this package registers itself on import (``base.register``); :func:`discover`
imports every module of the package, so a new codec file needs no edit elsewhere.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

from fedcomp.compression.base import CODECS
from fedcomp.compression.options import Option, merge_options

#: Traits :func:`codecs_with` answers for (class attributes of ``Compressor``).
TRAITS = ("sparse", "per_tensor_only", "secagg", "density_ramp", "seeded", "small_tensor", "requires_error_feedback")


def discover() -> None:
    """Import every module of ``fedcomp.compression`` (each codec module registers its codec)."""
    package = sys.modules[__package__]
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        importlib.import_module(f"{__package__}.{info.name}")


def codecs_with(**traits: bool) -> tuple[str, ...]:
    """Names of the registered codecs whose traits have the given truth values, by codec id.

    Parameters
    ----------
    **traits : bool
        Trait name (one of :data:`TRAITS`) -> wanted truth value: ``codecs_with(sparse=True)``
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
