"""Causal Transformers built with Hugging Face ``transformers`` from a local config (no download).

``model = "transformer"`` is a small Llama-architecture causal language model over bytes
(Touvron et al. 2023: token embedding, pre-norm RMSNorm, rotary causal self-attention with
``q_proj``/``k_proj``/``v_proj``/``o_proj``, SwiGLU MLP, untied LM head). It is an ordinary
``LlamaForCausalLM``, so a user's own Hugging Face causal LM (any ``*ForCausalLM``, built from its
config or loaded with ``from_pretrained``) goes through the same training, evaluation and
compression path. Needs the ``llm`` extra (``pip install -e ".[llm]"``).
"""

from __future__ import annotations

from typing import Any

import torch

from fedcomp.util.extras import require

#: The default small model: 2 layers, width 64, 4 heads, MLP 256 (164,160 fp32 parameters, 21 tensors).
TRANSFORMER_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,  # the default model's own head; a tied one travels once (fedcomp.statedict.untie)
}


def _transformers():
    return require("transformers", "model = 'transformer'")


def transformer_config(vocab_size: int = 256, seq_len: int = 80, **overrides):
    """A ``LlamaConfig`` for a small causal LM made here (no hub access).

    Parameters
    ----------
    vocab_size : int
        Tokens (256: one per byte).
    seq_len : int
        Longest input (``max_position_embeddings``).
    **overrides
        Any ``LlamaConfig`` field, replacing `TRANSFORMER_DEFAULTS`.
    """
    return _transformers().LlamaConfig(vocab_size=vocab_size, max_position_embeddings=seq_len,
                                       **{**TRANSFORMER_DEFAULTS, **overrides})


def build_transformer(config=None, seed: int | None = None) -> torch.nn.Module:
    """A randomly initialised causal LM from ``config`` (default `transformer_config`).

    Input int64 token ids ``(batch, seq)``; output a Hugging Face ``CausalLMOutputWithPast`` whose
    ``logits`` are ``(batch, seq, vocab)``. fp32 weights. ``seed`` fixes the initial weights (the
    server's and every client's copy are then identical); None uses the global torch RNG.
    """
    tf = _transformers()
    config = config or transformer_config()
    if seed is None:
        return tf.AutoModelForCausalLM.from_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return tf.AutoModelForCausalLM.from_config(config)
