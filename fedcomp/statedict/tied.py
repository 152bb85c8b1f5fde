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

The server sees no memory, only values: a third-party app that sends a tied tensor under both names
sends two equal entries. `equal_groups` finds such entries in the first global model: bit-identical
float tensors of one shape and dtype whose values look like a random draw (two separate tensors that
merely start at the same constant, such as the zero BatchNorm biases of a residual block and of its
shortcut, are not taken for one) and that are not the same place in two copies of one module (the
deep-copied layers of ``torch.nn.TransformerEncoder``). `find_tied` logs the groups, and
`tie_record` gives every name of a group the same values in each round's aggregate (their mean).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from logging import WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord
from flwr.common.logger import log

from fedcomp.statedict.arrays import array_to_numpy, numpy_to_array
from fedcomp.statedict.flat import FlatModel

#: A float tensor looks like a random draw (a parameter's initialisation or training, not a constant
#: or a pattern of a few values) from this many entries, with more than this many distinct values in
#: a sample of them (or more than half the sample distinct).
MIN_DISTINCT = 16
#: About this many entries, evenly spaced, are sampled for the distinct values and the first comparison.
_SAMPLE = 4096
#: Entries averaged at a time by `tie_arrays` (its float64 temporaries stay small).
_CHUNK = 1 << 20


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


def _sample(x: np.ndarray) -> np.ndarray:
    """About `_SAMPLE` evenly spaced entries of the flat ``x``."""
    return x[:: max(x.size // _SAMPLE, 1)]


def looks_random(x: np.ndarray) -> bool:
    """Whether the flat float tensor ``x`` holds a random-looking spread of values: at least
    `MIN_DISTINCT` entries, and more than `MIN_DISTINCT` distinct values in a sample of them (or more
    than half the sample). A constant (zeros, ones, BatchNorm's initial weights and statistics) or a
    few-valued pattern (a mask, an identity) does not."""
    if x.size < MIN_DISTINCT:
        return False
    distinct = np.unique(_sample(x)).size
    return distinct > MIN_DISTINCT or 2 * distinct > _sample(x).size


def equal_groups(model: FlatModel) -> list[tuple[str, ...]]:
    """Groups of float tensors of ``model`` that are one tensor under several names, as far as values
    tell: the same shape and dtype, bit-identical, and random-looking (`looks_random`), and not the
    same place in two copies of one module (`copied_modules`).

    Two separate parameters drawn at random do not start bit-identical; a tensor shared by two names
    (tied input/output embeddings sent as two entries) always is. Tensors that start at the same
    constant (the zero biases of two BatchNorm layers) are never grouped: nothing in their values
    says they are one tensor. Nor are the layers of a module copied with ``copy.deepcopy`` (the
    layers of ``torch.nn.TransformerEncoder``, an EMA teacher), whose every random tensor starts
    equal to its copy's.

    Returns
    -------
    list of tuple of str
        Each group's names in model order, the groups in the order of their first name; empty when
        no two tensors qualify.
    """
    bits = np.uint64 if model.flat.dtype == np.float64 else np.uint32
    candidates: dict[tuple, list[str]] = {}
    for k in model.float_keys:  # a sample first: only tensors that agree on it are compared whole
        x = model.float_view(k).reshape(-1)
        if looks_random(x):
            spec = model.specs[k]
            candidates.setdefault((spec.shape, spec.dtype, _sample(x.view(bits)).tobytes()), []).append(k)
    equal: list[list[str]] = []  # classes of bit-identical random-looking tensors (two names or more)
    for keys in candidates.values():
        while len(keys) > 1:
            first = model.float_view(keys[0]).view(bits)
            same = [k for k in keys[1:] if np.array_equal(first, model.float_view(k).view(bits))]
            if same:
                equal.append([keys[0], *same])
            keys = [k for k in keys[1:] if k not in same]
    class_of = {k: i for i, keys in enumerate(equal) for k in keys}
    groups = []
    for keys in equal:  # names joined by a pair that is not a copy; each connected part is a group
        parts = {k: {k} for k in keys}
        for i, a in enumerate(keys):
            for b in keys[i + 1:]:
                if parts[a] is not parts[b] and not copied_modules(a, b, class_of):
                    merged = parts[a] | parts[b]
                    for k in merged:
                        parts[k] = merged
        seen = []
        for part in parts.values():
            if len(part) > 1 and part not in seen:
                seen.append(part)
                groups.append(tuple(k for k in keys if k in part))
    order = {k: i for i, k in enumerate(model.keys)}
    return sorted(groups, key=lambda g: order[g[0]])


def copied_modules(a: str, b: str, class_of: Mapping[str, int]) -> bool:
    """Whether names ``a`` and ``b`` are the same place in two copies of one module: with their common
    dotted tail taken off (``layers.0`` and ``layers.1`` for ``layers.0.linear1.weight`` and
    ``layers.1.linear1.weight``), another name under the one prefix has its counterpart under the other
    in the same class of bit-identical random-looking tensors (``class_of``: name -> class). Tied
    embeddings are not: nothing else under ``transformer.wte`` matches anything under ``lm_head``."""
    pa, pb = a.split("."), b.split(".")
    while len(pa) > 1 and len(pb) > 1 and pa[-1] == pb[-1]:
        pa, pb = pa[:-1], pb[:-1]
    head_a, head_b = ".".join(pa) + ".", ".".join(pb) + "."
    for k, c in class_of.items():
        if k.startswith(head_a) and k != a and class_of.get(head_b + k[len(head_a):]) == c:
            return True
    return False


def find_tied(model: FlatModel) -> list[tuple[str, ...]]:
    """`equal_groups` of the first global model a server strategy sees, logged in one line naming
    every group (none: nothing logged)."""
    groups = equal_groups(model)
    if groups:
        names = "; ".join(" = ".join(repr(k) for k in g) for g in groups)
        log(WARNING, "fedcomp: kept tied: %s (the same values bit for bit: one tensor under several names, "
            "such as tied input/output embeddings sent as two entries). Every round gives each name of a group "
            "the mean of their aggregates. Sending such a tensor once saves its bytes "
            "(fedcomp.statedict.untie / retie). If they are separate tensors in your model that merely start "
            "equal, give them different initial values, or set the strategy's tied_groups = [] before it starts",
            names)
    return groups


def tie_arrays(values: MutableMapping[str, np.ndarray], groups: Iterable[Sequence[str]]) -> list[str]:
    """Give every name of each group (`equal_groups`) the mean of their values in ``values``, in place
    (a new array under each name of the group, in their dtype); returns the names set.

    Every name of a group is aggregated over the same replies with the same weights, so the
    weighted mean of the group's aggregates is their plain mean. A group whose values are already
    equal is left as it is (bit for bit), and so is one with fewer than two of its names in
    ``values`` or with names of other shapes or dtypes (values this model did not make).
    """
    changed = []
    for group in groups:
        keys = [k for k in group if k in values]
        arrays = [np.asarray(values[k]) for k in keys]
        if len(keys) < 2 or any(a.shape != arrays[0].shape or a.dtype != arrays[0].dtype for a in arrays):
            continue
        flat = [a.reshape(-1) for a in arrays]
        if all(np.array_equal(flat[0], f) for f in flat[1:]):
            continue
        mean = np.empty(flat[0].size, dtype=flat[0].dtype)
        for i in range(0, mean.size, _CHUNK):  # in float64, a chunk at a time
            acc = np.zeros(min(_CHUNK, mean.size - i), dtype=np.float64)
            for f in flat:
                acc += f[i: i + acc.size]
            mean[i: i + acc.size] = acc / len(flat)
        for i, k in enumerate(keys):  # each name its own array (a caller may change one in place)
            values[k] = mean.reshape(arrays[0].shape) if i == 0 else mean.reshape(arrays[0].shape).copy()
        changed += keys
    return changed


def tie_record(record: ArrayRecord, groups: Iterable[Sequence[str]]) -> ArrayRecord:
    """`tie_arrays` on a Flower ArrayRecord (bf16 included), in place; returns ``record``."""
    present = [[k for k in g if k in record] for g in groups]
    groups = [g for g in present if len(g) > 1 and len({record[k].dtype for k in g}) == 1]
    values = {k: array_to_numpy(record[k]) for g in groups for k in g}
    for k in tie_arrays(values, groups):
        record[k] = numpy_to_array(values[k], record[k].dtype)
    return record


def tie_list(arrays: list[np.ndarray], groups: Iterable[Sequence[str]]) -> list[np.ndarray]:
    """`tie_arrays` on a list of arrays (the legacy API's ``Parameters``), the names being the
    positions as strings (``"0"``, ``"1"``, ...); returns a new list."""
    values = {str(i): a for i, a in enumerate(arrays)}
    tie_arrays(values, groups)
    return list(values.values())


__all__ = ["MIN_DISTINCT", "copied_modules", "equal_groups", "find_tied", "looks_random", "retie", "tie_arrays",
           "tie_list", "tie_record", "tied_aliases", "untie"]
