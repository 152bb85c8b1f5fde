"""A tiny Llama base model (vocab 64) saved with save_pretrained (no download), built once per session."""

import pytest
import torch

from .helpers import SEQ


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=False)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("base")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return str(out)
