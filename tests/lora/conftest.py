"""A tiny Llama base model saved with save_pretrained (no download) and synthetic token windows."""

import pytest
import torch
from torch.utils.data import TensorDataset

SEQ = 16


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=False)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("base")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return str(out)


def windows(pid: int, n: int = 32) -> TensorDataset:
    """Client ``pid``'s text: a repeating pattern with a per-client stride (learnable, non-IID)."""
    g = torch.Generator().manual_seed(pid)
    start = torch.randint(0, 64, (n, 1), generator=g)
    seq = (start + torch.arange(SEQ + 1) * (1 + pid % 3)) % 64
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


@pytest.fixture(scope="session")
def byte_base_dir(tmp_path_factory):
    """A tiny byte-level Llama (vocab 256, 80 positions) for the Shakespeare windows."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=80, tie_word_embeddings=False)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("byte-base")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return str(out)
