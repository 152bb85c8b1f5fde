"""Carry a client's error-feedback state across a change of payload plan.

The payload plan (`fedcomp.client.plan.plan_units`) groups float parameters into
payloads: one per parameter, or one whole-model vector under ``MODEL_KEY`` for the sparse
codecs. The library changes that plan itself between rounds: a warm-up codec (``sign``, one
payload per tensor) followed by ``stc`` (one model payload), a per-layer rule or a small-tensor
codec in force only with some codecs, a node overriding the codec. The residual (and DGC's
momentum buffer) is kept per payload key, so a plan change would leave it under keys the new
plan no longer uses: the residual would be dropped, and ``sum(decoded sends) + residual ==
sum(updates)`` (the telescoping invariant of error feedback; Stich et al. 2018, Karimireddy
et al. 2019) would break by the lost residual.

`replan_states` cuts the saved state into per-parameter pieces (views, no copies) and
reassembles them in the new plan's grouping, so every entry of the residual and of the
momentum buffer reaches the payload that now carries its parameter. Codec memory such as
PowerSGD's warm-start Q belongs to one codec on one payload: it survives only where the
payload and its members are unchanged (a fresh Q is a valid start).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedcomp.compression.error_feedback import MOMENTUM, RESIDUAL
from fedcomp.protocol.messages import MODEL_KEY

#: State entries that hold one value per parameter entry (moved across plans); the rest is codec memory.
_PER_ENTRY = (RESIDUAL, MOMENTUM)


def _saved_members(states: Mapping[str, Mapping[str, np.ndarray]], float_keys: Sequence[str]) -> dict[str, list[str]]:
    """Member parameters of each saved payload key.

    A parameter's own payload is saved under its own name; the whole-model payload
    (``MODEL_KEY``) held, in model order, every float parameter that had no payload of its own
    (with error feedback on, every payload of a round saves a state, so the saved keys are the
    old plan's payload keys).
    """
    own = set(states) & set(float_keys)
    members = {k: [k] for k in states if k in own}
    if MODEL_KEY in states:
        members[MODEL_KEY] = [k for k in float_keys if k not in own]
    return members


def replan_states(states: Mapping[str, Mapping[str, np.ndarray]], units: Sequence[tuple[str, list[str], str]],
                  shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, dict[str, np.ndarray]], list[str]]:
    """Regroup saved per-payload state (``{payload key: {entry: array}}``) for the payload plan ``units``.

    Parameters
    ----------
    states : mapping
        What `fedcomp.compression.unflatten_states` returned for the saved state: per
        payload key of the round that saved it, ``"residual"`` and ``"momentum"`` (float
        arrays, fp32 or fp16, one entry per parameter entry: the payload's shape, or flat for
        ``MODEL_KEY``) and codec memory (``"<codec>/<key>"``).
    units : sequence of (payload key, member names, codec name)
        The plan of this round (`fedcomp.client.plan.plan_units`).
    shapes : mapping of str to tuple of int
        Every float parameter's shape, in model order (the members of every plan).

    Returns
    -------
    (states, dropped)
        ``states`` keyed by this plan's payload keys: a unit whose key and members are
        unchanged keeps its saved state as it was (same arrays); any other unit gets its
        residual / momentum assembled from its members' pieces (float32 unless every piece is
        fp16; members without a saved piece start from zero; absent if no member has one),
        flat for ``MODEL_KEY``, the parameter's shape otherwise, and no codec memory.
        ``dropped`` names saved payload keys whose sizes do not match the model (their state is
        not carried; the caller logs them). With an unchanged plan this returns ``states``
        unchanged.
    """
    sizes = {k: int(np.prod(s)) if s else 1 for k, s in shapes.items()}
    saved = _saved_members(states, list(shapes))
    plan = {ukey: list(members) for ukey, members, _ in units}
    if all(plan.get(k) == m for k, m in saved.items()):
        return {k: dict(v) for k, v in states.items()}, []
    pieces: dict[str, dict[str, np.ndarray]] = {entry: {} for entry in _PER_ENTRY}
    dropped = []
    for skey, members in saved.items():
        total = sum(sizes[m] for m in members)
        ok = True
        for entry in _PER_ENTRY:
            arr = states[skey].get(entry)
            if arr is None:
                continue
            if int(np.asarray(arr).size) != total:
                ok = False
                continue
            flat, off = np.asarray(arr).reshape(-1), 0
            for m in members:
                pieces[entry][m] = flat[off: off + sizes[m]]
                off += sizes[m]
        if not ok:
            dropped.append(skey)
    out: dict[str, dict[str, np.ndarray]] = {}
    for ukey, members, _ in units:
        if saved.get(ukey) == list(members):
            out[ukey] = dict(states[ukey])
            continue
        entry_state: dict[str, np.ndarray] = {}
        for entry in _PER_ENTRY:
            have = [pieces[entry].get(m) for m in members]
            if all(p is None for p in have):
                continue
            dtype = np.float16 if all(p is not None and p.dtype == np.float16 for p in have) else np.float32
            flat = np.concatenate([np.zeros(sizes[m], dtype) if p is None else p.astype(dtype, copy=False)
                                   for m, p in zip(members, have)])
            entry_state[entry] = flat if ukey == MODEL_KEY else flat.reshape(shapes[ukey])
        if entry_state:
            out[ukey] = entry_state
    return out, dropped


__all__ = ["replan_states"]
