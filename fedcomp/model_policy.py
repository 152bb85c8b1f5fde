"""Per-model codec defaults decided from the model's layers (Flower-free).

A setting that helps one model and hurts another is not a global default: it applies where the
model's layers call for it, and the server says once what it decided. Today that is BatchNorm:

- BatchNorm's affine parameters (``<bn>.weight`` / ``<bn>.bias``, recognised by the running
  statistics the same module registers) travel through ``small-tensor-compressor`` with the
  sparse codecs (stc, topk, randomk) while ``batchnorm-affine = "small"`` (the default). Measured on ``model = "resnet"`` (issue 25): with
  STC at density 0.01 over the whole model, top-k never picks them (per-entry updates of ~0.005
  against ~0.05 in the convolutions; relative compression error 1.0 on every BatchNorm tensor in
  rounds 1-3), so the global model's normalisation stays at its initial scale and shift while
  the running statistics (sent exactly) follow the clients' trained layers. They are under 1 % of
  the parameters (672 of 77,754 entries), so sending them dense costs about 2.7 KB per client and
  round.
"""

from __future__ import annotations

from collections.abc import Iterable

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
    return [k for k in keys if "." in k and k.rsplit(".", 1)[1] in ("weight", "bias") and k.rsplit(".", 1)[0] in modules]


def describe(keys: Iterable[str], numel: dict[str, int], codec) -> str | None:
    """One log line saying what the model's layers decided for ``codec`` (None if nothing).

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
    if not affine or codec.batchnorm_affine != "small" or codec.compressor not in ("stc", "topk", "randomk"):
        return None
    n = sum(numel[k] for k in affine)
    layers = len({k.rsplit(".", 1)[0] for k in affine})
    return (f"fedcomp: the model has {layers} BatchNorm layers: their {len(affine)} affine "
            f"parameters ({n} entries) travel with small-tensor-compressor '{codec.small_tensor_compressor}' instead of "
            f"'{codec.compressor}' (batchnorm-affine = \"small\"; \"codec\" turns this off)")


__all__ = ["batchnorm_affine_keys", "batchnorm_modules", "describe"]
