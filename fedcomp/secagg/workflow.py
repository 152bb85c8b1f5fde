"""``CompressedSecAggPlusWorkflow``: Flower's ``SecAggPlusWorkflow`` with a modulus sized per round,
packed masked vectors unpacked on arrival, and the bytes of every reply counted.

The four protocol stages, the masks, the secret sharing and the dropout recovery are Flower's
(``flwr.server.workflow.SecAggPlusWorkflow``, flwr 1.42); this subclass only

- sizes ``modulus_range`` each round (``secagg-modulus-bits = 0``): the smallest power of two that
  holds the sum of the available clients' quantized values, ``ceil(log2(n * Q + 1))`` bits, and
  halts the round (Flower's own "halted" path) if more clients were sampled than it can hold;
- unpacks masked vectors packed by :func:`fedcomp.secagg.client.packing_secaggplus_mod` back to
  the int64 arrays Flower sums (a malformed one turns that reply into an error: SecAgg+ then
  recovers that client as dropped);
- counts bytes: ``upload-bytes`` (masked vectors, as they travelled) and
  ``secagg-protocol-bytes`` (public keys, encrypted shares and unmasking shares of all stages).
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import ERROR

from flwr.app import Error, Message
from flwr.common import ndarray_to_bytes
from flwr.common.logger import log
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.server.workflow import SecAggPlusWorkflow

from ..compression import PayloadError
from .client import PACK_MAGIC, unpack_masked
from .encoding import modulus_bits_for

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
        super().__init__(num_shares, reconstruction_threshold,
                         modulus_range=1 << (modulus_bits or 32), **kwargs)
        self.round_bytes: dict[str, float] = {}

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
        self._mod_bits = None
        super().__call__(_CountingGrid(grid, self), context)

    def setup_stage(self, grid, context, state) -> bool:
        """Flower's setup stage with the modulus sized from the available clients; halts the round if
        the sample could overflow it."""
        self._available = context.client_manager.num_available()
        ok = super().setup_stage(grid, context, state)
        n = len(state.sampled_node_ids)
        self._mod_bits = state.mod_range.bit_length() - 1
        if n * state.quantization_range >= state.mod_range:
            log(ERROR, "fedcomp secagg: %d sampled clients can overflow modulus 2**%d with quantization range %d: "
                "round halted (raise 'secagg-modulus-bits' or use 0 = auto)", n, self._mod_bits,
                state.quantization_range)
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
        if Key.MASKED_PARAMETERS in rec and self._mod_bits is not None:
            try:
                rec[Key.MASKED_PARAMETERS] = [ndarray_to_bytes(unpack_masked(b, self._mod_bits))
                                              if b.startswith(PACK_MAGIC) else b for b in rec[Key.MASKED_PARAMETERS]]
            except PayloadError as exc:
                self.round_bytes["malformed-replies"] += 1
                log(ERROR, "fedcomp secagg: node %s sent a malformed masked vector (%s): treated as dropped",
                    reply.metadata.src_node_id, exc)
                if sent is None:
                    raise
                return Message(Error(code=_MALFORMED, reason=f"malformed packed masked vector: {exc}"), reply_to=sent)
        return reply
