"""Presets: one argument that picks the codecs both ways, error feedback and the first contact.

``CompressedStrategy(FedAvg(...), preset="lora")`` in a FlowerTune-style app (adapters from
``get_peft_model_state_dict``, ``compression_mod`` on the ClientApp, nothing else):

- ``sign`` with error feedback upward and ``sign`` downward (server-side error feedback, one scale
  per adapter tensor, each client's copy kept for its catch-ups): on the Shakespeare LoRA benchmark
  (``benchmarks/llm_lora.py``; figures in ``docs/benchmarks/llm.md``) it keeps the most of fp32's
  eval-loss gain of any setting at >= 20x fewer bytes both ways; sparse codecs (STC, top-k) downward
  drift under partial participation (a client that missed rounds trains from a copy that lacks much
  of the recent change), and so does sign on a random half (``randsign``); exact catch-ups and an
  int8 download keep more of the gain for more bytes;
- the seeded start (``Download(init="auto")``): the strategy recognises adapters at peft's
  initialisation (``lora_B`` zero, ``lora_A`` Kaiming-uniform) and draws ``lora_A`` from a seed
  that every client rebuilds, so no client downloads the adapters dense;
- lagging clients get the cheaper of the missed sign payloads and one sign-coded difference from
  the copy they hold (per-client error feedback);
- no downstream correction (``Download(correction=0)``, the default): counting each update from the
  global model rather than the client's copy kept less of the gain with a sign download than without
  it; it rescues sparse downloads from diverging, which still keep less than sign
  (``docs/benchmarks/llm.md``).
"""

from __future__ import annotations

from typing import Any

from fedcomp.download.options import Download

#: preset name -> the ``CompressedStrategy`` arguments it sets
PRESETS: dict[str, dict[str, Any]] = {
    "lora": {"compressor": "sign", "error_feedback": True,
             "downstream": Download("sign", init="auto", catchup="smallest")},
}


def apply_preset(preset: str | None, given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments with ``preset``'s settings filled in.

    Parameters
    ----------
    preset : str or None
        A name of `PRESETS` (None: ``given`` unchanged).
    given : dict
        The arguments as passed (their values).
    defaults : dict
        The constructor's defaults of the same names.

    Raises
    ------
    ValueError
        An unknown preset, or an argument the preset sets passed with another value (naming both).
    """
    if preset is None:
        return given
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {sorted(PRESETS)}")
    out = dict(given)
    for key, value in PRESETS[preset].items():
        if given.get(key, defaults.get(key)) != defaults.get(key) and given[key] != value:
            raise ValueError(f"preset {preset!r} sets {key} = {value!r}, but {key} = {given[key]!r} was passed too: "
                             "drop one of them")
        out[key] = value
    return out


#: The download codec of ``CompressedStrategy(downstream="auto")`` by the upload codec: the download
#: costs about what the upload does. Sign-like uploads get ``sign`` downward (1 bit an entry, one scale per
#: tensor), sparse ones ``stc`` at `SPARSE_DOWNLOAD_FACTOR` times the upload's density, the others int8
#: (8 bits an entry, every entry every round); each with server-side error feedback.
#: A sparse upload denser than `MAX_SPARSE_DOWNLOAD` / `SPARSE_DOWNLOAD_FACTOR` gets int8 too.
LIBRARY_DOWNSTREAM = {"sign": "sign", "randsign": "sign", "stc": "stc", "topk": "stc", "randomk": "stc"}
#: The int8 download of the uploads `LIBRARY_DOWNSTREAM` does not name (quantisers, low rank, half precision).
OTHER_DOWNSTREAM = "int8"
#: A sparse download's density over the upload's (at most `MAX_SPARSE_DOWNLOAD`): the broadcast carries the sum of many
#: clients' sparse updates, so it keeps more entries (Sattler et al., IEEE TNNLS 2019, use a denser
#: downstream than upstream; fedcomp's app sends STC 0.05 for STC 0.01 up).
SPARSE_DOWNLOAD_FACTOR = 5.0
#: The densest sparse download ``"auto"`` picks: past it STC's one magnitude for a quarter of the entries
#: or more is coarser than int8's blocks.
MAX_SPARSE_DOWNLOAD = 0.25


def library_downstream(compressor: str, density: float | None, upload_density: float, local_dp,
                       weighted_mean: bool) -> tuple[str, float | None]:
    """``(downstream codec, downstream density)`` for ``CompressedStrategy(downstream="auto")``, the
    library's default: the upload codec's counterpart (`LIBRARY_DOWNSTREAM`, else `OTHER_DOWNSTREAM`),
    with server-side error feedback, so that both directions cost about the same; except where a
    compressed download cannot apply: ``compressor = "none"`` (fp32 both ways), local DP (each client
    noises its update against the global model it was sent) and inner strategies that need every
    client's weights (Krum, FedMedian, Flower's DP wrappers: the global model they see must be the
    one the clients trained from). Why: an 8-bit download of a 1-bit or sparse upload would be most of
    what travels; the comparison on an ordinary Flower app is `benchmarks/wire.py`
    (``docs/benchmarks/wire.md``).

    Parameters
    ----------
    compressor : str
        The upload codec.
    density : float or None
        ``Download.density`` as given (kept when given).
    upload_density : float
        The upload codec's density (a sparse download's is `SPARSE_DOWNLOAD_FACTOR` times it; past
        `MAX_SPARSE_DOWNLOAD` the download is int8).
    local_dp : LocalDP or None
    weighted_mean : bool
        Whether the wrapped strategy aggregates by a weighted mean of the clients' weights
        (`fedcomp.strategies.aggregate.averages_by_weight`; `fedcomp.strategies.legacy_strategy.legacy_weighted_mean`).
    """
    if compressor == "none" or local_dp is not None or not weighted_mean:
        return "none", density
    codec = LIBRARY_DOWNSTREAM.get(compressor, OTHER_DOWNSTREAM)
    if codec == "stc" and density is None:
        density = SPARSE_DOWNLOAD_FACTOR * float(upload_density)
        if density > MAX_SPARSE_DOWNLOAD:
            return OTHER_DOWNSTREAM, None
    return codec, density


#: The library's codec defaults where they differ from the run-config keys' (which are the reference
#: app's): BatchNorm's running statistics travel exactly (``"small"``) unless ``batchnorm_stats`` is given.
#: An ordinary Flower app (a BatchNorm ResNet from scratch on sklearn digits, 10 clients, Dirichlet 0.5,
#: sign with error feedback, 8 rounds, dense download) kept more of its accuracy with exact statistics than
#: with their sign-coded change, and the statistics are a small part of most models' bytes.
LIBRARY_CODEC_DEFAULTS = {"batchnorm-stats": "small"}


def library_codec_params(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` (codec parameters by their Python or run-config names, as ``CompressedStrategy`` takes
    them) with `LIBRARY_CODEC_DEFAULTS` for the keys not given."""
    given = {k.replace("_", "-") for k in params}
    return {**{k.replace("-", "_"): v for k, v in LIBRARY_CODEC_DEFAULTS.items() if k not in given}, **params}


__all__ = ["LIBRARY_CODEC_DEFAULTS", "LIBRARY_DOWNSTREAM", "MAX_SPARSE_DOWNLOAD", "OTHER_DOWNSTREAM", "PRESETS",
           "SPARSE_DOWNLOAD_FACTOR", "apply_preset", "library_codec_params", "library_downstream"]
