"""Model and data of the example, as a FlowerTune app has them (the texts come from fedcomp.task.text_data).

The base model is loaded with ``AutoModelForCausalLM.from_pretrained`` (a local directory or a hub
id), frozen and wrapped with peft's LoRA; only the adapter state dict is exchanged. Each client's
text is one speaking role of Shakespeare's plays (next-character windows).
"""

from functools import lru_cache

import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from fedcomp.task.text_data import load_text_partition


@lru_cache(maxsize=1)
def get_model(base_model: str, r: int, alpha: float, targets: str):
    """Base model + LoRA adapters (loaded once per process; the adapters are set every round)."""
    base = AutoModelForCausalLM.from_pretrained(base_model)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets.split(","), task_type="CAUSAL_LM")
    return get_peft_model(base, config)


def model_from_config(cfg):
    return get_model(str(cfg["base-model"]), int(cfg["lora-r"]), float(cfg["lora-alpha"]), str(cfg["lora-targets"]))


def load_data(partition_id: int, num_partitions: int, seed: int, split: str = "train"):
    """``(input bytes, next bytes)`` windows of this client's speaking role."""
    return load_text_partition(partition_id, num_partitions, seed, split)


def train(model, data, steps: int, lr: float, seed: int) -> float:
    """``steps`` AdamW steps on the adapters; the mean loss."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    loader = DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed))
    total, done = 0.0, 0
    while done < steps:
        for x, y in loader:
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, done = total + float(loss.detach()), done + 1
            if done == steps:
                break
    return total / max(done, 1)


@torch.no_grad()
def test(model, data) -> float:
    """Mean next-character loss."""
    model.eval()
    losses = [torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten(), reduction="sum")
              for x, y in DataLoader(data, batch_size=64)]
    return float(sum(losses)) / max(sum(y.numel() for _, y in DataLoader(data, batch_size=64)), 1)
