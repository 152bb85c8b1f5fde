"""BatchNorm-aware codec options decided from the model's layers (Flower-free).

- ``batchnorm-affine = "small"``: BatchNorm's affine parameters (``<bn>.weight`` / ``<bn>.bias``,
  recognised by the running statistics the same module registers) travel through
  ``small-tensor-compressor`` with the sparse codecs (stc, topk, randomk); the server says so once
  in the log. They are a small share of a model's parameters that whole-model top-k may leave
  unselected for many rounds (the per-layer ``layer-compression-error`` metric shows it);
  sending them dense costs their full fp32 (or fp16) size per client and round. The default is
  ``"codec"``; ``benchmarks/federated.py --suite accuracy`` compares both ("bn-affine" rows;
  docs/benchmarks/accuracy.md).
"""

from __future__ import annotations

from collections.abc import Iterable

from fedcomp.compression import codecs_with

_STATS = ("running_mean", "running_var")


def batchnorm_modules(keys: Iterable[str]) -> set[str]:
    """Names of the modules that hold BatchNorm running statistics (``<module>.running_mean``)."""
    return {k.rsplit(".", 1)[0] for k in keys if "." in k and k.rsplit(".", 1)[1] in _STATS}


def batchnorm_affine_keys(keys: Iterable[str]) -> list[str]:
    """The affine parameters (``<module>.weight`` / ``<module>.bias``) of BatchNorm modules, in ``keys`` order.

    Parameters
    ----------
    keys : iterable of str
        State-dict keys of a model (float tensors at least).

    Returns
    -------
    list of str
        Keys whose module also registers ``running_mean`` or ``running_var``.
    """
    keys = list(keys)
    modules = batchnorm_modules(keys)
    return [k for k in keys
            if "." in k and k.rsplit(".", 1)[1] in ("weight", "bias") and k.rsplit(".", 1)[0] in modules]


def describe(keys: Iterable[str], numel: dict[str, int], codec) -> str | None:
    """One log line saying what ``batchnorm-affine = "small"`` does on this model (None if nothing).

    Parameters
    ----------
    keys : iterable of str
        The model's state-dict keys.
    numel : dict of str to int
        Entries per key.
    codec : fedcomp.config.CodecConfig
        The codec in force.
    """
    affine = batchnorm_affine_keys(keys)
    if not affine or codec.batchnorm_affine != "small" or codec.compressor not in codecs_with(sparse=True):
        return None
    n = sum(numel[k] for k in affine)
    layers = len({k.rsplit(".", 1)[0] for k in affine})
    return (f"fedcomp: the model has {layers} BatchNorm layers: their {len(affine)} affine "
            f"parameters ({n} entries) travel with small-tensor-compressor '{codec.small_tensor_compressor}' "
            f"instead of '{codec.compressor}' (batchnorm-affine = \"small\"; \"codec\" turns this off)")


__all__ = ["batchnorm_affine_keys", "batchnorm_modules", "describe"]
