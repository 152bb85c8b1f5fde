"""What a model is trained and scored on, for classifiers and causal language models alike.

A classifier returns logits ``(batch, classes)`` for labels ``(batch,)``; a causal language model
(any Hugging Face ``*ForCausalLM``, or a module returning ``(batch, seq, vocab)``) returns one
prediction per position for targets ``(batch, seq)`` (the next token at every position). Loss and
accuracy are taken per predicted item: per sample for a classifier, per predicted character/token
for a language model (LEAF's Shakespeare reports next-character accuracy this way). Targets equal
to ``IGNORE_INDEX`` are not scored. Used by local training and by evaluation on both sides.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

#: Target value that is not scored (PyTorch's and Hugging Face's convention).
IGNORE_INDEX = -100


def logits_of(output) -> torch.Tensor:
    """The logits of a model output: a tensor as it is, or a Hugging Face output's ``.logits``."""
    return output if isinstance(output, torch.Tensor) else output.logits


def loss_and_hits(output, targets: torch.Tensor, reduction: str = "mean") -> tuple[torch.Tensor, int, int]:
    """Cross-entropy, correct predictions and scored items of one batch.

    Parameters
    ----------
    output : Tensor or model output
        Logits ``(batch, classes)`` or ``(batch, seq, vocab)`` (any float dtype; the loss is taken in
        fp32, so a bf16 autocast forward loses no precision in the loss).
    targets : Tensor
        int64 ``(batch,)`` or ``(batch, seq)``, matching the logits without their last dimension.
    reduction : {"mean", "sum"}
        Of the loss over scored items.

    Returns
    -------
    (loss, correct, count)
        0-d fp32 loss, number of argmax hits and number of scored items (ints).

    Raises
    ------
    ValueError
        Logits and targets whose shapes do not match.
    """
    logits = logits_of(output)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    flat, tgt = logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
    loss = F.cross_entropy(flat, tgt, reduction=reduction, ignore_index=IGNORE_INDEX)
    scored = tgt != IGNORE_INDEX
    with torch.no_grad():
        correct = int(((flat.argmax(-1) == tgt) & scored).sum())
    return loss, correct, int(scored.sum())
