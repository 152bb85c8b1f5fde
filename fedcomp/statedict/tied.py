"""Tied parameters (one tensor under two state_dict names): one travels, both are set.

A model whose output layer shares the input embedding's weight (Hugging Face
``tie_word_embeddings=True``: ``lm_head.weight`` is ``model.embed_tokens.weight``; GPT-2's
``lm_head.weight`` is ``transformer.wte.weight``; any ``head.weight = emb.weight`` in plain PyTorch)
lists that one tensor twice in its ``state_dict()``. Sent as two tensors, it costs twice the bytes,
and the two copies are compressed, aggregated and noised separately: they come apart on the server,
and a client loading both keeps whichever it loads last. Here a name whose tensor is the very same
memory as an earlier name's (same storage pointer, offset, shape, strides and dtype) is an *alias*:
`untie` drops it before sending and `retie` fills it from its source before
``load_state_dict``, which sets the shared tensor once.

Tensors that merely overlap (a view of part of another) are not aliases: both travel.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def _identity(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


def tied_aliases(state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The names of ``state_dict`` that repeat an earlier name's tensor.

    Parameters
    ----------
    state_dict : mapping of str to torch.Tensor
        A model's ``state_dict()`` (its tensors share memory with the model's parameters, so tied
        parameters share it with each other), in model order.

    Returns
    -------
    dict of str to str
        ``{alias: source}``, the source being the first name (in ``state_dict``'s order) holding
        that tensor; empty when nothing is tied. Zero-element tensors are never aliases (they own no
        memory to share).
    """
    first: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for k, t in state_dict.items():
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        ident = _identity(t)
        if ident in first:
            aliases[k] = first[ident]
        else:
            first[ident] = k
    return aliases


def untie(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` without its aliases (`tied_aliases`): each tied tensor once, under its
    first name; the order of the other names is kept. Nothing is copied."""
    aliases = tied_aliases(state_dict)
    return {k: v for k, v in state_dict.items() if k not in aliases}


def retie(state_dict: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """``state_dict`` with every alias set to its source's value, for ``model.load_state_dict``
    (``aliases``: `tied_aliases` of the model's own ``state_dict()``).

    A state dict that carries an alias too (from a sender that did not untie) gets the source's value
    under it as well: the tied tensor takes one value, the source's, whatever the order of loading.

    Raises
    ------
    ValueError
        An alias whose source is not in ``state_dict`` (naming both).
    """
    out = dict(state_dict)
    for alias, source in aliases.items():
        if source not in out:
            raise ValueError(f"'{alias}' is tied to '{source}', which the received weights do not hold")
        out[alias] = out[source]
    return out


__all__ = ["retie", "tied_aliases", "untie"]
