"""A ClientApp for LoRA fine-tuning of a causal LM (FlowerTune-style), with ``compression_mod``.

Each node loads the frozen base model once per process (``base-model``), wraps it with peft, and per
round: sets the received adapters, trains them with AdamW on its own token windows, replies with
the adapter state dict only. ``compression_mod`` turns that reply into compressed adapter updates
and rebuilds compressed downloads; nothing else travels.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader, Dataset

from fedcomp.client.mod import compression_mod
from fedcomp.protocol.messages import server_round
from fedcomp.statedict import to_record, to_state_dict
from fedcomp.task.lora import LoraSettings, adapter_state, load_adapters, lora_model


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy of ``model(input_ids=x)`` against ``y`` (int64, ``(batch, seq)``)
    and the number of correct next-token predictions."""
    logits = model(input_ids=x).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
    return loss, int((logits.argmax(-1) == y).sum())


def train_adapters(model: torch.nn.Module, data: Dataset, steps: int, batch_size: int, lr: float,
                   seed: int, device: torch.device | str = "cpu", weight_decay: float = 0.0) -> float:
    """``steps`` AdamW steps (Loshchilov & Hutter 2019; FlowerTune's optimizer) on the trainable
    parameters (the adapters), batches drawn with ``seed``. Returns the mean training loss."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    total, done = 0.0, 0
    while done < steps:
        for x, y in DataLoader(data, batch_size=batch_size, shuffle=True, generator=gen):
            loss, _ = lm_loss(model, x.to(device), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach())
            done += 1
            if done == steps:
                break
    return total / max(done, 1)


@torch.no_grad()
def eval_lm(model: torch.nn.Module, data: Dataset, batch_size: int = 64,
            device: torch.device | str = "cpu") -> tuple[float, float]:
    """Mean next-token loss (nats) and accuracy in [0, 1] over every position of ``data``."""
    model.train(False)  # evaluation mode (dropout off)
    total, hits, n = 0.0, 0, 0
    for x, y in DataLoader(data, batch_size=batch_size):
        loss, h = lm_loss(model, x.to(device), y.to(device))
        total += float(loss) * y.numel()
        hits += h
        n += y.numel()
    return (total / n, hits / n) if n else (0.0, 0.0)


def lora_client_app(data_fn: Callable[[Context], Dataset]) -> ClientApp:
    """A ClientApp (``mods=[compression_mod]``) that fine-tunes LoRA adapters on ``data_fn(context)``.

    Run config: ``base-model``, ``lora-r``, ``lora-alpha``, ``lora-targets``, ``lora-dropout``,
    ``base-quantization`` (`fedcomp.task.lora.LoraSettings`), ``local-steps`` (default 10),
    ``batch-size`` (16), ``lr`` (AdamW, 1e-3), ``seed``.

    Parameters
    ----------
    data_fn : callable
        ``data_fn(context) -> Dataset`` of ``(input_ids, targets)`` int64 pairs, shape ``(seq,)`` each.
    """
    app = ClientApp(mods=[compression_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        rc = context.run_config
        settings = LoraSettings.from_mapping(rc)
        model = lora_model(settings)
        load_adapters(model, to_state_dict(msg.content["arrays"]))
        t0 = time.perf_counter()
        pid = int(context.node_config.get("partition-id", 0))
        seed = int(rc.get("seed", 0)) * 100_003 + server_round(msg) * 1009 + pid
        data = data_fn(context)
        loss = train_adapters(model, data, int(rc.get("local-steps", 10)), int(rc.get("batch-size", 16)),
                              float(rc.get("lr", 1e-3)), seed)
        metrics = {"num-examples": len(data), "train-loss": loss, "train-seconds": time.perf_counter() - t0}
        return Message(content=RecordDict({"arrays": to_record(adapter_state(model)),
                                           "metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


__all__ = ["eval_lm", "lm_loss", "lora_client_app", "lora_model", "train_adapters"]
