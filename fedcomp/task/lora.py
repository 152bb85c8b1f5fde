"""LoRA fine-tuning as FlowerTune does it: a frozen base model, peft adapters, only adapters travel.

FlowerTune LLM (Flower's templates and leaderboard) loads the base model (4 bit on GPUs), wraps it
with peft's LoRA (Hu et al., ICLR 2022) on ``q_proj`` and ``v_proj``, and exchanges only the adapter
state dict (``peft.get_peft_model_state_dict`` / ``set_peft_model_state_dict``). Here the same,
with fedcomp compressing the adapters in both directions; the server never loads or sends the base
weights: it learns the adapters' names and shapes from the base model's *config* (a model built on
PyTorch's ``meta`` device holds no weights) and starts from LoRA's own initialisation (B = 0, A
seeded), which clients rebuild from the seed (`fedcomp.download.seeded_init`).

Needs the ``llm`` extra (``pip install -e ".[llm]"``: transformers, peft). 4-bit loading needs
CUDA and bitsandbytes.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedcomp.download.seeded_init import SeededInit, lora_init
from fedcomp.util.declared_key import Key, defaults, table
from fedcomp.util.extras import install_hint

FINETUNE_MODES = ("full", "lora")
#: Largest accepted ``lora-r``: LoRA ranks are 4-256 in practice; a rank above every hidden size of
#: any model would allocate ``r * (d_in + d_out)`` floats per adapter for nothing, and a huge
#: one would exhaust the node's memory.
MAX_LORA_R = 65536
QUANTIZATIONS = ("none", "4bit")
#: The run-config keys of LoRA fine-tuning; defaults are FlowerTune's general-NLP baseline
#: (r = 32, alpha = 64 on q_proj and v_proj).
LORA_KEYS = table(
    Key("finetune", str, "full", "train the whole model, or a frozen base-model with peft LoRA adapters (only "
        "the adapters travel; dataset = \"shakespeare\")", choices=FINETUNE_MODES),
    Key("base-model", str, "", "finetune = \"lora\": a save_pretrained directory or a Hugging Face model id",
        rule="non-empty with finetune = \"lora\""),
    Key("lora-r", int, 32, "adapter rank r", lo=1, hi=MAX_LORA_R, rule=f"integer in [1, {MAX_LORA_R}]"),
    Key("lora-alpha", int, 64, "scaling numerator: the update is alpha / r * B A", rule="number > 0"),
    Key("lora-targets", str, "q_proj,v_proj", "comma-separated module names (peft target_modules)",
        rule="at least one name"),
    Key("lora-dropout", float, 0.0, "dropout of the adapters' input", rule="[0, 1)"),
    Key("base-quantization", str, "none", "load the base model in 4 bit (NF4 via bitsandbytes; CUDA only)",
        choices=QUANTIZATIONS),
)
LORA_DEFAULTS: dict[str, Any] = defaults(LORA_KEYS)


@dataclass(frozen=True)
class LoraSettings:
    """Run-config keys of LoRA fine-tuning (``finetune = "lora"``), declared in `LORA_KEYS`.

    Attributes
    ----------
    base_model : str
        ``base-model``: a local directory written by ``save_pretrained`` or a Hugging Face model id
        (as FlowerTune's ``model.name``).
    r : int
        ``lora-r``: adapter rank, >= 1.
    alpha : float
        ``lora-alpha``: scaling numerator (the update is ``alpha / r * B A``), > 0.
    targets : tuple of str
        ``lora-targets``: comma-separated module names (peft ``target_modules``).
    dropout : float
        ``lora-dropout`` in [0, 1).
    quantization : str
        ``base-quantization``: "none" or "4bit" (NF4 via bitsandbytes, CUDA only).
    """

    base_model: str
    r: int = LORA_DEFAULTS["lora-r"]
    alpha: float = float(LORA_DEFAULTS["lora-alpha"])
    targets: tuple[str, ...] = tuple(LORA_DEFAULTS["lora-targets"].split(","))
    dropout: float = LORA_DEFAULTS["lora-dropout"]
    quantization: str = LORA_DEFAULTS["base-quantization"]

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> LoraSettings:
        """Parse and check the run config.

        Raises
        ------
        ValueError
            Naming the key: empty ``base-model``, ``lora-r`` < 1, ``lora-alpha`` <= 0, no targets,
            ``lora-r`` outside [1, `MAX_LORA_R`], ``lora-dropout`` outside [0, 1), an unknown
            ``base-quantization``.
        """
        d = LORA_DEFAULTS
        base = LORA_KEYS["base-model"].read(cfg)
        if not isinstance(base, str) or not base.strip():
            raise ValueError("run config 'base-model' must name the base model (a local directory written by "
                             "save_pretrained, or a Hugging Face model id) when finetune = 'lora'")
        rk = LORA_KEYS["lora-r"]
        r = rk.read(cfg)
        if isinstance(r, bool) or not isinstance(r, int) or not rk.lo <= r <= rk.hi:
            raise ValueError(f"run config 'lora-r' must be an {rk.rule}, got {r!r}")
        alpha = cfg.get("lora-alpha", d["lora-alpha"])
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < float("inf"):
            raise ValueError(f"run config 'lora-alpha' must be a number > 0, got {alpha!r}")
        targets = cfg.get("lora-targets", d["lora-targets"])
        names = tuple(t.strip() for t in str(targets).split(",") if t.strip())
        if not isinstance(targets, str) or not names:
            raise ValueError(f"run config 'lora-targets' must be comma-separated module names, got {targets!r}")
        dropout = cfg.get("lora-dropout", d["lora-dropout"])
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"run config 'lora-dropout' must be in [0, 1), got {dropout!r}")
        quant = cfg.get("base-quantization", d["base-quantization"])
        if quant not in QUANTIZATIONS:  # not Key.read: its message sorts the choices
            raise ValueError(f"run config 'base-quantization' must be one of {QUANTIZATIONS}, got {quant!r}")
        return cls(base.strip(), int(r), float(alpha), names, float(dropout), quant)

    def peft_config(self):
        """The ``peft.LoraConfig`` (task CAUSAL_LM)."""
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, target_modules=list(self.targets),
                          lora_dropout=self.dropout, task_type="CAUSAL_LM")


def _libs():
    try:
        import peft
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(f"finetune = 'lora' needs transformers and peft: {install_hint('llm')}") from exc
    return transformers, peft


def _looks_like_path(name: str) -> bool:
    """A local directory rather than a hub id ("org/name" has one slash at most)."""
    return (name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name
            or pathlib.Path(name).expanduser().exists())


def _source(name: str) -> str:
    """What ``from_pretrained`` gets: the directory (``~`` expanded, otherwise as written, so that
    ``./gpt2`` stays a path and is never taken for the hub id ``gpt2``), or the hub id as given.

    Raises
    ------
    ValueError
        ``name`` is path-like (starts with ".", "/" or "~", or names an existing file) but is not
        an existing directory: no such directory, or a file such as ``config.json`` (give its
        directory). Path-like names are never looked up on the hub.
    """
    if not _looks_like_path(name):
        return name
    where = os.path.expanduser(name)
    if not os.path.exists(where):
        raise ValueError(f"run config 'base-model' = {name!r} cannot be loaded: no such directory {where} "
                         "(a path-like name is a local directory, never a Hugging Face hub id)")
    if not os.path.isdir(where):
        raise ValueError(f"run config 'base-model' = {name!r} is a file, not a directory: give the directory "
                         "written by save_pretrained (the one holding config.json), or a Hugging Face hub id")
    return where


def check_base_model(name: str) -> None:
    """Check ``base-model`` before a run starts, without loading anything (``fedcomp-simulation``).

    A hub id passes (whether it resolves is only known when it loads). A path-like name must be an
    absolute path (``~`` allowed) to an existing directory, because the ServerApp and the ClientApps
    run in the SuperLink's working directory, not in the caller's.

    Raises
    ------
    ValueError
        One line naming the key: a relative path, no such directory, or a file instead of a directory.
    """
    if not _looks_like_path(name):
        return
    if not os.path.isabs(os.path.expanduser(name)):
        raise ValueError(f"run config 'base-model' = {name!r} is a relative path: give an absolute one (the apps "
                         "run in the SuperLink's working directory, not in yours)")
    _source(name)


def _local_only(name: str) -> dict[str, Any]:
    """``from_pretrained`` keywords: a local directory is read from disk only (no hub look-up)."""
    return {"local_files_only": True} if _looks_like_path(name) else {}


def _cannot_load(name: str, exc: Exception) -> ValueError:
    where = pathlib.Path(name).expanduser()
    if _looks_like_path(name) and not where.exists():
        why = f"no such directory {where}"
    elif where.is_dir():
        why = f"{where} is not a model saved with save_pretrained ({type(exc).__name__}: {str(exc)[:200]})"
    else:
        why = (f"not a local directory, and the Hugging Face hub id could not be loaded ({type(exc).__name__}: "
               f"{str(exc).splitlines()[0][:200]}); on a machine without internet, save the model with "
               "save_pretrained and give that directory")
    return ValueError(f"run config 'base-model' = {name!r} cannot be loaded: {why}")


def base_config(settings: LoraSettings):
    """The base model's ``PretrainedConfig`` (config.json only; no weights).

    Raises
    ------
    ValueError
        The base model cannot be found or read (the message says why).
    """
    transformers, _ = _libs()
    source = _source(settings.base_model)
    try:
        return transformers.AutoConfig.from_pretrained(source, **_local_only(settings.base_model))
    except (OSError, ValueError, KeyError) as exc:
        raise _cannot_load(settings.base_model, exc) from None


def load_base_model(settings: LoraSettings, device: torch.device | str = "cpu") -> torch.nn.Module:
    """Load the base causal LM (``AutoModelForCausalLM.from_pretrained``), frozen.

    With ``quantization = "4bit"``: NF4 weights, bf16 compute (bitsandbytes), as FlowerTune loads
    Mistral-7B, then ``peft.prepare_model_for_kbit_training``.

    Raises
    ------
    ValueError
        The base model cannot be loaded (no such directory, not a saved model, hub unreachable), or
        4-bit loading asked for on a node without CUDA.
    """
    transformers, peft = _libs()
    kwargs: dict[str, Any] = {}
    if settings.quantization == "4bit":
        if not torch.cuda.is_available():
            raise ValueError("run config base-quantization = '4bit' needs CUDA (bitsandbytes NF4); this node has no "
                             "CUDA device: use base-quantization = 'none' on CPU")
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    name = settings.base_model
    source = _source(name)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(source, **kwargs, **_local_only(name))
    except (OSError, ValueError, KeyError) as exc:
        raise _cannot_load(name, exc) from None
    if settings.quantization == "4bit":
        model = peft.prepare_model_for_kbit_training(model)
    else:
        model.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def wrap(base: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """``peft.get_peft_model(base, LoraConfig(...))``: only the adapters are trainable.

    Raises
    ------
    ValueError
        No module of the base model matches ``lora-targets`` (peft's message, naming the key).
    """
    _, peft = _libs()
    try:
        return peft.get_peft_model(base, settings.peft_config())
    except ValueError as exc:
        raise ValueError(f"run config 'lora-targets' = {','.join(settings.targets)!r}: {exc}") from None


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter state dict (``peft.get_peft_model_state_dict``), detached CPU tensors."""
    _, peft = _libs()
    return {k: v.detach().cpu() for k, v in peft.get_peft_model_state_dict(model).items()}


def load_adapters(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Set the adapters (``peft.set_peft_model_state_dict``); every adapter tensor must be given.

    Raises
    ------
    ValueError
        Keys that are not this model's adapters, or adapters left out.
    """
    _, peft = _libs()
    want = set(peft.get_peft_model_state_dict(model))
    if set(state) != want:
        raise ValueError(f"adapter keys differ: missing {sorted(want - set(state))[:3]}, "
                         f"unknown {sorted(set(state) - want)[:3]}")
    peft.set_peft_model_state_dict(model, dict(state))


def adapter_shapes(settings: LoraSettings) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the adapters, from the base model's config alone (built on the ``meta``
    device: no weights are read or allocated). What the server needs to start a run."""
    transformers, _ = _libs()
    config = base_config(settings)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
        peft_model = wrap(model, settings)
    _, peft = _libs()
    return {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(peft_model).items()}


def initial_adapters(settings: LoraSettings, seed: int) -> tuple[dict[str, torch.Tensor], SeededInit]:
    """LoRA's initial adapters (``lora_A`` uniform in ``+-1/sqrt(fan_in)`` from ``seed``, ``lora_B``
    zero, as peft initialises them) and their `SeededInit`, so that
    ``CompressedStrategy(..., downstream=..., downstream_init=init)`` sends clients the seed, not
    the values. fp32, as FlowerTune's adapters."""
    shapes = adapter_shapes(settings)
    init = lora_init(shapes, seed)
    return {k: torch.from_numpy(v) for k, v in init.values(shapes).items()}, init


_MODELS: dict[tuple, torch.nn.Module] = {}


def lora_model(settings: LoraSettings, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The peft model for ``settings``: the base is loaded and wrapped once per process and kept
    (FlowerTune loads a 7B base; loading it every round would dominate the round). The adapters are
    set every round (`load_weights`)."""
    key = (settings, str(device))
    if key not in _MODELS:
        _MODELS[key] = wrap(load_base_model(settings, device), settings)
    return _MODELS[key]


def load_weights(model: torch.nn.Module, record, lora: bool) -> None:
    """Set a model from a received ArrayRecord: the adapters (``lora``) or the whole state dict, tied
    parameters (an output layer sharing the embedding) set from the one name that travels
    (`fedcomp.statedict.retie`)."""
    from fedcomp.statedict import retie, tied_aliases, to_state_dict

    if lora:
        load_adapters(model, to_state_dict(record))
    else:
        model.load_state_dict(retie(record.to_torch_state_dict(), tied_aliases(model.state_dict())))


def weights_record(model: torch.nn.Module, lora: bool):
    """What a client replies with (and the server's initial model): an ArrayRecord of the adapters
    (``lora``) or of the state dict, each tied tensor once (`fedcomp.statedict.untie`)."""
    from flwr.app import ArrayRecord

    from fedcomp.statedict import to_record, untie

    return to_record(adapter_state(model)) if lora else ArrayRecord(untie(model.cpu().state_dict()))


def base_fingerprint(model: torch.nn.Module) -> float:
    """A float64 sum of every frozen (non-adapter) tensor's values, to check the base is untouched."""
    total = 0.0
    for name, p in model.named_parameters():
        if "lora_" not in name:
            total += float(p.detach().double().abs().sum())
    return total


__all__ = ["FINETUNE_MODES", "LORA_DEFAULTS", "LORA_KEYS", "LoraSettings", "adapter_shapes", "adapter_state",
           "base_config", "base_fingerprint", "initial_adapters", "load_adapters", "load_base_model", "load_weights",
           "lora_model", "weights_record", "wrap"]
