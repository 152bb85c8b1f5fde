"""Flower's client-side clipping bound kept through a lossy codec.

``DifferentialPrivacyClientSideFixedClipping`` calibrates the server's noise to the clipping norm C:
every update it aggregates must have L2 norm <= C. Flower's ``fixedclipping_mod`` clips the dense
update, but a lossy codec's *decoded* update can be longer than what it encoded (QSGD's and EDEN's
unbiased scales, int8 and fp16 rounding up). Here the client decodes its own payloads and, if their
norm exceeds C, encodes the update again scaled by ``C / decoded norm`` (with the same codec seed),
until the decoded update meets the bound; the bound is checked on the decoded payloads, not assumed.

Source: Andrew et al., "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021 (the
client-side clipping Flower implements); the sensitivity argument needs the bound on what is sent.
"""

from __future__ import annotations

import math

import torch

from fedcomp.compression import decompress
from fedcomp.compression.feedback_pass import Unit, UnitResult

#: Relative margins below C of the successive rescalings (a codec whose decoded norm is not exactly
#: proportional to its input's, fp16 rounding for one, may need a second, smaller factor). The first,
#: 2**-22 (two float32 rounding steps), is what an exact float32 codec (``none``) needs when Flower's
#: clipping mod already clipped the update: Flower scales in float32 and ``reply - received`` rounds
#: again, so the update reaching the mod can exceed C by a few float32 ulps (norm 1.00000005 for C = 1);
#: the rescaled update then stays within 2**-22 relative (+ float32 rounding) of Flower's own.
MARGINS = (2.0**-22, 1e-4, 1e-2, 1e-1)


def decoded_norm(units: list[Unit], results: dict[str, UnitResult]) -> float:
    """L2 norm (float64) of the float update the server decodes from ``results``' payloads."""
    sq = 0.0
    for u in units:
        t = decompress(results[u.key].payload, max_numel=max(sum(u.sizes), 1), expected_shape=tuple(u.shape))
        sq += float(torch.linalg.vector_norm(t.reshape(-1), dtype=torch.float64)) ** 2
    return math.sqrt(sq)


def encode_within_norm(encode, deltas: dict[str, tuple[torch.Tensor, list[float]]], units: list[Unit],
                       clipping_norm: float, codec_name: str) -> dict[str, UnitResult]:
    """Encode ``deltas`` so that the decoded update has L2 norm <= ``clipping_norm``.

    Parameters
    ----------
    encode : callable
        ``encode(deltas) -> {unit key: UnitResult}`` (consumes its argument), the same codec,
        seed and saved state every call (with error feedback the residual is added to the scaled
        update, so what is sent, ``scaled update + residual`` compressed, is what is bounded).
    deltas : dict
        Unit key -> (flat float update, per-member squared norms); left unchanged.
    units : list of Unit
    clipping_norm : float
        C > 0, Flower's ``clipping_norm`` from the train config.
    codec_name : str
        For the error message.

    Returns
    -------
    dict
        The results of the last encoding; its decoded norm is <= C (the update scaled by the
        product of the factors used, 1 when the first encoding met the bound).

    Raises
    ------
    ValueError
        The decoded norm still exceeds C after ``len(MARGINS)`` rescalings (e.g. an error-feedback
        residual longer than C: scaling the update cannot shorten it), naming the codec and C.
    """
    factor, norm = 1.0, math.inf
    for attempt in range(len(MARGINS) + 1):
        scaled = {k: (t * factor, [n * factor * factor for n in norms]) for k, (t, norms) in deltas.items()}
        results = encode(scaled)
        norm = decoded_norm(units, results)
        if norm <= clipping_norm:
            return results
        if attempt < len(MARGINS):
            factor *= clipping_norm / norm * (1.0 - MARGINS[attempt])
    raise ValueError(f"codec {codec_name!r}: the decoded update has L2 norm {norm:.9g} > clipping_norm {clipping_norm} "
                     f"after {len(MARGINS)} rescalings; the client-side clipping bound cannot be met with this codec "
                     "(with error feedback: the residual alone exceeds it; use error-feedback = false)")


__all__ = ["MARGINS", "decoded_norm", "encode_within_norm"]
