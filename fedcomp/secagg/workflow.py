"""``CompressedSecAggPlusWorkflow``: Flower's ``SecAggPlusWorkflow`` with a modulus sized per round,
packed masked vectors unpacked on arrival, and the bytes of every reply counted.

The four protocol stages, the masks, the secret sharing and the dropout recovery are Flower's
(``flwr.server.workflow.SecAggPlusWorkflow``, flwr 1.42); this subclass only

- sizes ``modulus_range`` each round (``secagg-modulus-bits = 0``): the smallest power of two that
  holds the sum of the available clients' quantized values, ``ceil(log2(n * Q + 1))`` bits, and
  halts the round (Flower's own "halted" path) if more clients were sampled than it can hold, then
  raises :class:`SecAggHalted` with the reason (every later round would halt too);
- checks every masked vector before Flower sums it (2 blobs, int64, shapes ``(1,)`` and
  ``(k,)``, values in ``[0, modulus_range)``; raw ``.npy`` parsed without pickle) and unpacks those
  packed by :func:`fedcomp.secagg.client.packing_secaggplus_mod` back to the int64 arrays Flower
  sums (a malformed one turns that reply into an error: SecAgg+ then recovers that client as
  dropped);
- counts bytes: ``upload-bytes`` (masked vectors, as they travelled) and
  ``secagg-protocol-bytes`` (public keys, encrypted shares and unmasking shares of all stages).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from logging import ERROR

import numpy as np
from flwr.app import Error, Message
from flwr.common import ndarray_to_bytes
from flwr.common.logger import log
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.server.workflow import SecAggPlusWorkflow

from fedcomp.compression import PayloadError
from fedcomp.secagg.client import PACK_MAGIC, unpack_masked
from fedcomp.secagg.encoding import modulus_bits_for

#: Flower's error code for a ClientApp exception (used for a reply whose packed vector is malformed).
_MALFORMED = 2


class _CountingGrid:
    """A Grid proxy: forwards every call, unpacks and counts the SecAgg+ records of each reply."""

    def __init__(self, grid, workflow: CompressedSecAggPlusWorkflow) -> None:
        self._grid, self._wf = grid, workflow

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        sent = {m.metadata.dst_node_id: m for m in messages}
        out = []
        for reply in self._grid.send_and_receive(list(sent.values()), timeout=timeout):
            out.append(self._wf._on_reply(reply, sent.get(reply.metadata.src_node_id)))
        return out


class SecAggHalted(RuntimeError):
    """A SecAgg+ round was halted because the fixed modulus cannot hold the sampled clients' sum:
    every later round would halt too, so the run stops (the message names the fix)."""


class CompressedSecAggPlusWorkflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow with a per-round modulus, packed vectors and byte counts.

    Parameters
    ----------
    num_shares, reconstruction_threshold : int or float
        As in ``SecAggPlusWorkflow`` (Flower's names; run config ``secagg-shares`` /
        ``secagg-threshold``).
    modulus_bits : int
        0 = size the modulus each round from the available clients (see module docstring);
        otherwise fixed ``modulus_range = 2**modulus_bits`` (checked against every round's sample).
    **kwargs
        ``max_weight``, ``clipping_range``, ``quantization_range``, ``timeout`` as in Flower.

    Attributes
    ----------
    round_bytes : dict
        Of the last round: ``upload-bytes``, ``secagg-protocol-bytes``, ``malformed-replies``.
    """

    def __init__(self, num_shares: float, reconstruction_threshold: float, *, modulus_bits: int = 0,
                 **kwargs) -> None:
        self._fixed_bits = modulus_bits
        self._available = 2
        self._ctx = None
        super().__init__(num_shares, reconstruction_threshold,
                         modulus_range=1 << (modulus_bits or 32), **kwargs)
        self.round_bytes: dict[str, float] = {}
        #: Bits of the modulus of the current or last round (None until its setup stage has run).
        self.round_modulus_bits: int | None = None

    @property
    def modulus_range(self) -> int:  # type: ignore[override]
        """``2**modulus_bits`` if fixed, else sized for the clients available this round."""
        if self._fixed_bits:
            return 1 << self._fixed_bits
        return 1 << modulus_bits_for(max(self._available, 2), self.quantization_range)

    @modulus_range.setter
    def modulus_range(self, value: int) -> None:
        if self._fixed_bits:
            self._fixed_bits = int(value).bit_length() - 1

    def __call__(self, grid, context) -> None:
        """One SecAgg+ round (Flower's four stages) through a counting, unpacking grid proxy."""
        self.round_bytes = {"upload-bytes": 0.0, "secagg-protocol-bytes": 0.0, "malformed-replies": 0}
        self.round_modulus_bits = None
        self._ctx = context
        self.halted: str | None = None
        strategy = getattr(context, "strategy", None)
        if hasattr(strategy, "max_weight") and strategy.max_weight is None:  # SharedRandomKStrategy's bound
            strategy.max_weight = float(self.max_weight)
        super().__call__(_CountingGrid(grid, self), context)
        if self.halted:
            raise SecAggHalted(self.halted)

    def setup_stage(self, grid, context, state) -> bool:
        """Flower's setup stage with the modulus sized from the available clients; halts the round if
        the sample could overflow it."""
        self._available = context.client_manager.num_available()
        ok = super().setup_stage(grid, context, state)
        n = len(state.sampled_node_ids)
        self.round_modulus_bits = state.mod_range.bit_length() - 1
        if n * state.quantization_range >= state.mod_range:
            self.halted = (f"{n} sampled clients can overflow modulus 2**{self.round_modulus_bits} with "
                           f"quantization range {state.quantization_range}: round halted, run stopped (raise 'secagg-modulus-bits' or "
                           "use 0 = auto)")
            log(ERROR, "fedcomp secagg: %s", self.halted)
            return False
        return ok

    def _on_reply(self, reply: Message, sent: Message | None) -> Message:
        if reply.has_error() or RECORD_KEY_CONFIGS not in reply.content.config_records:
            return reply
        rec = reply.content.config_records[RECORD_KEY_CONFIGS]
        for key, value in rec.items():
            blobs = value if isinstance(value, list) else [value]
            n = float(sum(len(b) for b in blobs if isinstance(b, bytes)))
            self.round_bytes["upload-bytes" if key == Key.MASKED_PARAMETERS else "secagg-protocol-bytes"] += n
        if Key.MASKED_PARAMETERS in rec and self.round_modulus_bits is not None:
            try:
                rec[Key.MASKED_PARAMETERS] = self._checked_masked(rec[Key.MASKED_PARAMETERS])
            except PayloadError as exc:
                self.round_bytes["malformed-replies"] += 1
                log(ERROR, "fedcomp secagg: node %s sent a malformed masked vector (%s): treated as dropped",
                    reply.metadata.src_node_id, exc)
                if sent is None:
                    raise
                return Message(Error(code=_MALFORMED, reason=f"malformed masked vector: {exc}"), reply_to=sent)
        return reply

    def _expected_k(self) -> int | None:
        """The round's number of masked values (``strategy._proj.k``), None if the strategy has no projection."""
        proj = getattr(getattr(self._ctx, "strategy", None), "_proj", None)
        return None if proj is None else int(proj.k)

    def _checked_masked(self, value) -> list[bytes]:
        """A reply's masked vector as the int64 ``.npy`` blobs Flower sums, after checking it.

        Expected: a list of 2 blobs (packed by :func:`~fedcomp.secagg.client.pack_masked` or raw
        ``.npy``, parsed without pickle), int64 arrays of shapes ``(1,)`` (the weight) and ``(k,)``
        (the round's k values; shape unchecked when the strategy has no ``_proj``), every value in
        ``[0, modulus_range)``.

        Raises
        ------
        PayloadError
            Anything else (wrong count, type, dtype, shape or range; not ``.npy``; pickled data).
        """
        if not isinstance(value, list) or len(value) != 2 or not all(isinstance(b, bytes) for b in value):
            raise PayloadError("masked vector: expected 2 byte blobs (weight, k values)")
        k = self._expected_k()
        out = []
        for i, blob in enumerate(value):
            if blob.startswith(PACK_MAGIC):
                arr = unpack_masked(blob, self.round_modulus_bits)
            else:
                try:
                    arr = np.load(io.BytesIO(blob), allow_pickle=False)
                except Exception as exc:  # noqa: BLE001 - any parse failure is a malformed reply
                    raise PayloadError(f"masked vector blob {i}: not packed, not a plain .npy ({exc})") from None
                if not isinstance(arr, np.ndarray):
                    raise PayloadError(f"masked vector blob {i}: not a single array")
            if arr.dtype != np.int64:
                raise PayloadError(f"masked vector blob {i}: dtype {arr.dtype}, expected int64")
            want = (1,) if i == 0 else ((k,) if k is not None else None)
            if (want is not None and arr.shape != want) or arr.ndim != 1:
                raise PayloadError(f"masked vector blob {i}: shape {arr.shape}, expected {want or '(k,)'}")
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= (1 << self.round_modulus_bits)):
                raise PayloadError(f"masked vector blob {i}: values outside [0, 2**{self.round_modulus_bits})")
            out.append(ndarray_to_bytes(np.ascontiguousarray(arr)))
        return out
