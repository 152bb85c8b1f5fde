"""The server-to-client direction's defaults: the run-config value ``downstream = "auto"``.

A federation pays for what the server sends as much as for what clients send: with a dense
download, the default run's 319x fewer uploaded bytes are 2x in total. ``"auto"`` (the default)
compresses the download too, with what ``benchmarks/both_ways.py`` measured best on the default
federation (digits, CNN, 10 clients, 50 rounds, 3 seeds; ``benchmarks/results/both_ways.json``):

- full-model training: STC (Sattler et al., IEEE TNNLS 2019, in both directions with server-side
  error feedback) at density `AUTO_DENSITY`, whatever the upload's density (a sparser
  download loses accuracy: the clients train from a broadcast model that lags the global one);
- LoRA fine-tuning (``finetune = "lora"``): ``sign`` (every entry moves each round, so a client that
  missed rounds under partial participation does not drift; one scale per adapter tensor; the server
  keeps each client's copy for its catch-ups: ``benchmarks/llm_lora.py``);
- ``compressor = "none"``: no compression either way (the fp32 baseline stays fp32 both ways);
- ``secagg = true``: dense (the secure path sends the model as Flower's SecAgg+ workflow does; an
  explicit codec there is refused).

The first model a client gets is the seeded start (`fedcomp.download.seeded_init`), never
the model dense (``downstream-init``). ``downstream-correction = "auto"`` counts each client's update
from the global model rather than from its compressed copy (`fedcomp.download.correction`)
when the clients train with AdamW and the download is sparse: on the Transformer from scratch (STC 4 %
up, STC 5 % down, 20 rounds, 3 seeds) it is 2.2 points better (median); with SGD (the default CNN) it was
1.4 points worse.
"""

from __future__ import annotations

from fedcomp.compression import CODECS

#: Downstream codec and density "auto" chooses for full-model training.
AUTO_CODEC = "stc"
AUTO_DENSITY = 0.05
#: Downstream codec "auto" chooses for LoRA adapters.
AUTO_LORA_CODEC = "sign"


def resolve_downstream(requested: str, density: float, compressor: str, finetune: str,
                       secagg: bool) -> tuple[str, float]:
    """``(downstream codec, downstream density)`` for run config ``downstream`` = ``requested``.

    Parameters
    ----------
    requested : str
        "auto", "none" or a codec name.
    density : float
        Run config ``downstream-density`` (0: the default, the upload's density for an explicit codec,
        `AUTO_DENSITY` under "auto").
    compressor : str
        The upload codec ("none": no compression either way under "auto").
    finetune : str
        "full" or "lora".
    secagg : bool
        Run config ``secagg``.

    Returns
    -------
    (str, float)
        The codec ("none" for a dense download) and its density (0: the upload's).
    """
    if requested != "auto":
        return requested, density
    if secagg or compressor == "none":
        return "none", density
    if finetune == "lora":
        return AUTO_LORA_CODEC, density
    return AUTO_CODEC, density or AUTO_DENSITY


#: Client optimizers with which ``downstream-correction = "auto"`` turns the correction on (with a sparse
#: downstream codec): AdamW moves every weight by about ``lr`` a step, and its local training re-learns
#: what a sparse download left out (measured: the Transformer, docs/benchmarks/both-ways.md); with SGD
#: (the default CNN) the correction cost accuracy.
AUTO_CORRECTION_OPTIMIZERS = ("adamw",)


def resolve_correction(requested: str, downstream: str, optimizer: str, dp: str = "none",
                       error_feedback: bool | str = True) -> float:
    """The strategy's ``downstream_correction`` for run config ``downstream-correction`` = ``requested``.

    Parameters
    ----------
    requested : {"auto", "on", "off"}
    downstream : str
        The resolved downstream codec (`resolve_downstream`; "none": dense).
    optimizer : str
        Run config ``optimizer`` of the clients.
    dp : str
        Run config ``dp`` ("client-level": the clipped sum is not corrected).
    error_feedback : bool or "ef21"
        Run config ``error-feedback`` ("ef21": innovations, not updates, are folded).

    Returns
    -------
    float
        1.0 (on) or 0.0 (off); "auto": on for a sparse downstream codec (STC, top-k, rand-k, randsign:
        ``Compressor.sparse``) with an optimizer of `AUTO_CORRECTION_OPTIMIZERS`, off where the
        strategy cannot apply it (client-level DP, EF21; "on" there is refused by the strategy).
    """
    if requested != "auto":
        return 1.0 if requested == "on" else 0.0
    sparse = downstream != "none" and CODECS[downstream].sparse
    applies = dp != "client-level" and error_feedback != "ef21"
    return 1.0 if sparse and applies and optimizer in AUTO_CORRECTION_OPTIMIZERS else 0.0


__all__ = ["AUTO_CODEC", "AUTO_CORRECTION_OPTIMIZERS", "AUTO_DENSITY", "AUTO_LORA_CODEC", "resolve_correction",
           "resolve_downstream"]
