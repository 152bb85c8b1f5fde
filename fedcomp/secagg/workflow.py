"""``CompressedSecAggPlusWorkflow``: Flower's ``SecAggPlusWorkflow`` with a modulus sized per round,
packed masked vectors unpacked on arrival, and the bytes of every reply counted.

The four protocol stages, the masks, the secret sharing and the dropout recovery are Flower's
(``flwr.server.workflow.SecAggPlusWorkflow``, flwr 1.42); this subclass only

- sizes ``modulus_range`` each round (``secagg-modulus-bits = 0``): the smallest power of two that
  holds the sum of the sampled clients' quantized values, ``ceil(log2(n * Q + 1))`` bits (from the
  sample itself, so a node joining while the round samples cannot overflow it); with a fixed
  modulus it halts the round if more clients were sampled than it can hold, then raises
  `SecAggHalted` with the reason (every later round would halt too);
- skips, with its reason in `CompressedSecAggPlusWorkflow.round_skipped`, a round that
  samples fewer than 2 clients, one in which no node answers the setup stage with keys (naming the
  likely cause: ClientApps without the secure mod), and one whose unmasked weight sum disagrees
  with the clients' reported ``num_examples`` (a client masked another weight than it reported);
- raises the reconstruction threshold of a round to more than half its shares where Flower's
  rounding of a fractional ``secagg-threshold`` gives at most half (clients refuse such a setup:
  `fedcomp.secagg.guard`);
- lets a round continue without the nodes that dropped before handing out their key shares
  (Flower 1.42 asks their neighbours for shares they never received, and the round fails);
- checks every masked vector before Flower sums it (2 blobs, int64, shapes ``(1,)`` and
  ``(k,)``, values in ``[0, modulus_range)``; raw ``.npy`` parsed without pickle) and unpacks those
  packed by `fedcomp.secagg.client.packing_secaggplus_mod` back to the int64 arrays Flower
  sums (a malformed one turns that reply into an error: SecAgg+ then recovers that client as
  dropped);
- counts bytes: ``upload-bytes`` (masked vectors, as they travelled) and
  ``secagg-protocol-bytes`` (public keys, encrypted shares and unmasking shares of all stages).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from logging import ERROR, WARNING

import numpy as np
from flwr.app import ArrayRecord, Error, Message
from flwr.common.logger import log
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation import secaggplus_workflow as _flower_workflow

from fedcomp.compression import PayloadError
from fedcomp.config.secagg import allows_split, majority_threshold
from fedcomp.download.secagg import FIT_ARRAYS, SecAggDownload
from fedcomp.download.shared_step import SharedStep
from fedcomp.secagg.encoding import modulus_bits_for
from fedcomp.secagg.protocol_packing import PACK_KEY, check_masked, is_packed_key, pack_record, unpack_record
from fedcomp.strategies.wire_bytes import WireCount

#: What a node that answers SecAgg+ without the secure mod most likely lacks.
MOD_HINT = ("its ClientApp must run SecAgg+'s client mod: fedcomp's ClientApp(mods=[secagg_mod, compression_mod]), or "
            "Flower's secaggplus_mod (fedcomp's packing_secaggplus_mod) first in a ClientApp's mods")

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
        wf, msgs = self._wf, list(sent.values())
        model = wf._on_send(msgs)
        wf.wire.sent(wf._round, "train", msgs, model)
        replies = list(self._grid.send_and_receive(msgs, timeout=timeout))
        wf.wire.received(wf._round, "train", replies, model)  # as they travelled, before unpacking
        out = [wf._on_reply(reply, sent.get(reply.metadata.src_node_id)) for reply in replies]
        wf._on_replies(out)
        return out


class _WeightMismatch(RuntimeError):
    """Raised inside Flower's unmask stage, before the strategy sees the sum: the round is refused."""


class _SampleSizing:
    """The strategy, with the size of each ``configure_fit`` sample handed to the workflow."""

    def __init__(self, strategy, workflow: CompressedSecAggPlusWorkflow) -> None:
        self._strategy, self._wf = strategy, workflow

    def __getattr__(self, name):
        return getattr(self._strategy, name)

    def configure_fit(self, *args, **kwargs):
        sample = self._strategy.configure_fit(*args, **kwargs)
        self._wf._available = len(sample)  # the auto modulus holds exactly this sample's sum
        return sample


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
    round_skipped : dict
        Round -> why that round applied no sum (fewer than 2 sampled, no node with the secure mod,
        a weight sum that disagrees with the reported counts, too few shares, ...).
    """

    def __init__(self, num_shares: float, reconstruction_threshold: float, *, modulus_bits: int = 0,
                 download: SecAggDownload | None = None, pack_protocol: bool = True, **kwargs) -> None:
        self._fixed_bits = modulus_bits
        #: Whether the setup request asks nodes to pack SecAgg+'s keys and tokens (`protocol_packing`).
        self.pack_protocol = pack_protocol
        self._packed_nodes: set[int] = set()  # nodes whose setup reply of this round came packed
        #: The compressed download of the train messages' model (None: the model travels dense).
        self.download = download
        #: Every message of every stage both ways, serialised, per round (`fedcomp.strategies.wire_bytes`);
        #: SecAgg+'s own records count on the wire and not in the fp32 equivalent, which a plain app
        #: without SecAgg+ would send (the model dense both ways).
        self.wire = WireCount(protocol=(RECORD_KEY_CONFIGS,))
        self._available = 2
        self._ctx = None
        super().__init__(num_shares, reconstruction_threshold,
                         modulus_range=1 << (modulus_bits or 32), **kwargs)
        self.round_bytes: dict[str, float] = {}
        #: Bits of the modulus of the current or last round (None until its setup stage has run).
        self.round_modulus_bits: int | None = None
        self.round_skipped: dict[int, str] = {}
        self._state = None
        self._round = 0
        self._setup_errors: list[str] = []

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
        self._setup_errors = []
        self._packed_nodes = set()
        cfg = context.state.config_records.get(MAIN_CONFIGS_RECORD, {})
        self._round = int(cfg.get(WorkflowKey.CURRENT_ROUND, self._round + 1))
        strategy = getattr(context, "strategy", None)
        if hasattr(strategy, "max_weight") and strategy.max_weight is None:  # SharedRandomKStrategy's bound
            strategy.max_weight = float(self.max_weight)
        if hasattr(strategy, "unpacking_workflow"):  # SharedRandomKStrategy(pack=True) needs this workflow
            strategy.unpacking_workflow = True
        if hasattr(strategy, "round_threshold"):  # set again by this round's setup stage
            strategy.round_threshold = None
        super().__call__(_CountingGrid(grid, self), context)
        if self.halted:
            raise SecAggHalted(self.halted)

    def _skip(self, reason: str) -> bool:
        """Record why this round applies no sum, log it, and return False (Flower's "halted")."""
        self.round_skipped[self._round] = reason
        log(WARNING, "fedcomp secagg round %d skipped (model kept): %s", self._round, reason)
        return False

    def setup_stage(self, grid, context, state) -> bool:
        """Flower's setup stage with the modulus sized from the sample (auto) or checked against it
        (fixed: halts the round and, after it, the run if the sample could overflow it); a round that
        samples fewer than 2 clients, or in which no node answers with keys, is skipped with its reason."""
        self._state = state
        strategy = context.strategy
        context.strategy = _SampleSizing(strategy, self)
        try:
            ok = super().setup_stage(grid, context, state)
        finally:
            context.strategy = strategy
        if not state.mod_range:  # Flower stopped before configuring the round
            return self._skip(f"{len(state.nid_to_fitins)} client(s) sampled: SecAgg+ needs at least 2")
        n = len(state.sampled_node_ids)
        self.round_modulus_bits = state.mod_range.bit_length() - 1
        if hasattr(strategy, "round_threshold"):  # distributed DP: clients size their noise shares by it
            strategy.round_threshold = int(state.threshold)
        if not state.active_node_ids:
            reasons = sorted(set(self._setup_errors))[:3]
            log(ERROR, "fedcomp secagg: none of the %d sampled nodes answered the SecAgg+ setup stage with keys "
                "(%s): %s", n, "; ".join(reasons), MOD_HINT)
            return self._skip(f"no sampled node answered the SecAgg+ setup stage with keys ({'; '.join(reasons)}); "
                              + MOD_HINT)
        if n * state.quantization_range >= state.mod_range:
            self.halted = (f"{n} sampled clients can overflow modulus 2**{self.round_modulus_bits} with "
                           f"quantization range {state.quantization_range}: round halted, run stopped (raise "
                           "'secagg-modulus-bits' or use 0 = auto)")
            log(ERROR, "fedcomp secagg: %s", self.halted)
            return False
        if not ok:
            return self._skip(f"too few nodes answered the setup stage for threshold {state.threshold}")
        return ok

    def share_keys_stage(self, grid, context, state) -> bool:
        """Flower's share-keys stage; then the nodes that handed out no key shares leave the round (no
        neighbour holds a share of theirs or masks with them), so it continues without them."""
        if not super().share_keys_stage(grid, context, state):
            return self._skip(f"too few nodes shared their keys for threshold {state.threshold}")
        shared = set(state.active_node_ids)
        gone = state.sampled_node_ids - shared
        if gone:
            log(WARNING, "fedcomp secagg round %d: %d node(s) dropped before sharing their keys; the round "
                "continues without them", self._round, len(gone))
            state.sampled_node_ids = shared
            state.nid_to_neighbours = {nid: nb & shared for nid, nb in state.nid_to_neighbours.items()
                                       if nid in shared}
        return True

    def collect_masked_vectors_stage(self, grid, context, state) -> bool:
        """Flower's collect stage (replies checked and unpacked by the grid proxy)."""
        if not super().collect_masked_vectors_stage(grid, context, state):
            return self._skip(f"too few masked vectors for threshold {state.threshold}")
        return True

    def unmask_stage(self, grid, context, state) -> bool:
        """Flower's unmask stage, with the unmasked weight sum checked against the clients' reported
        ``num_examples`` before the strategy sees the sum: each client's weight is
        ``round(num_examples / max_weight * Q)``, and a sum that differs (a client masked an inflated,
        zero or negative weight) refuses the round."""
        expected = _weight_sum(state)
        try:
            with _checking_weight_sum(expected, state.mod_range):
                ok = super().unmask_stage(grid, context, state)
        except _WeightMismatch as exc:
            log(ERROR, "fedcomp secagg round %d refused (model kept): %s", self._round, exc)
            charge = getattr(context.strategy, "charge_refused_round", None)
            if callable(charge):  # distributed DP: the unmasked, noised sum was seen all the same
                charge(self._round, len(state.legacy_results))
            return self._skip(str(exc))
        if not ok:
            return self._skip(f"too few unmasking shares for threshold {state.threshold}")
        return True

    def _on_send(self, messages: list[Message]) -> ArrayRecord | None:
        """Raise a setup's threshold to more than half its shares (the clients refuse less); the train
        messages' model rewritten by the download. Returns the train messages' dense model record as it
        was (None: no train message in ``messages``)."""
        for m in messages:
            rec = m.content.config_records.get(RECORD_KEY_CONFIGS)
            if rec is not None and rec.get(Key.STAGE) != Stage.SETUP and m.metadata.dst_node_id in self._packed_nodes:
                pack_record(rec.get(Key.STAGE), rec)
            if rec is None or rec.get(Key.STAGE) != Stage.SETUP:
                continue
            if self.pack_protocol:
                rec[PACK_KEY] = True
            shares, threshold = int(rec[Key.SHARE_NUMBER]), int(rec[Key.THRESHOLD])
            if allows_split(threshold, shares):
                need = majority_threshold(shares)
                log(WARNING, "fedcomp secagg round %d: secagg-threshold %s gives %d of %d shares (a server could "
                    "split a client's neighbours): raised to %d", self._round, self.reconstruction_threshold,
                    threshold, shares, need)
                rec[Key.THRESHOLD] = need
                if self._state is not None:
                    self._state.threshold = need
        if self.download is not None:
            # a node that answered the setup without packing runs Flower's own mod, not fedcomp: the model dense
            plain = set() if not self.pack_protocol else {m.metadata.dst_node_id for m in messages} - self._packed_nodes
            step = getattr(getattr(self._ctx, "strategy", None), "last_step", None)  # SharedRandomKStrategy's
            return self.download.on_send(self._round, messages, plain, step if isinstance(step, SharedStep) else None)
        fit = next((m for m in messages if FIT_ARRAYS in m.content.array_records), None)
        return None if fit is None else fit.content[FIT_ARRAYS]

    def _on_replies(self, replies: list[Message]) -> None:
        """The download notes what each node that answered its train message holds now."""
        if self.download is None:
            return
        self.download.on_replies(replies)
        if resynced := self.download.resynced():
            log(WARNING, "fedcomp secagg round %d: node(s) %s answered without the model copy the server recorded "
                "for them (an error, or another digest); they get a first contact next time", self._round,
                sorted(resynced))

    def _on_reply(self, reply: Message, sent: Message | None) -> Message:
        stage = None if sent is None else sent.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.STAGE)
        if stage == Stage.SETUP:
            if reply.has_error():
                self._setup_errors.append(str(reply.error.reason).strip().splitlines()[-1][:200]
                                          if reply.error.reason else f"error code {reply.error.code}")
                return reply
            rec = reply.content.config_records.get(RECORD_KEY_CONFIGS, {})
            if Key.PUBLIC_KEY_1 not in rec or Key.PUBLIC_KEY_2 not in rec:
                reason = f"node {reply.metadata.src_node_id} answered the SecAgg+ setup stage without public keys"
                self._setup_errors.append(reason)
                log(ERROR, "fedcomp secagg: %s: %s", reason, MOD_HINT)
                return Message(Error(code=_MALFORMED, reason=f"{reason}: {MOD_HINT}"), reply_to=sent)
        if reply.has_error() or RECORD_KEY_CONFIGS not in reply.content.config_records:
            return reply
        rec = reply.content.config_records[RECORD_KEY_CONFIGS]
        for key, value in rec.items():
            blobs = value if isinstance(value, list) else [value]
            n = float(sum(len(b) for b in blobs if isinstance(b, bytes)))
            self.round_bytes["upload-bytes" if key == Key.MASKED_PARAMETERS else "secagg-protocol-bytes"] += n
        if stage == Stage.SETUP and is_packed_key(rec.get(Key.PUBLIC_KEY_1)):
            self._packed_nodes.add(reply.metadata.src_node_id)  # its later requests go packed too
        try:
            unpack_record(stage, rec)  # Flower's workflow reads its own forms
        except PayloadError as exc:
            log(ERROR, "fedcomp secagg: node %s sent a malformed packed record (%s): treated as dropped",
                reply.metadata.src_node_id, exc)
            if sent is None:
                raise
            return Message(Error(code=_MALFORMED, reason=f"malformed packed SecAgg+ record: {exc}"), reply_to=sent)
        if Key.MASKED_PARAMETERS in rec and self.round_modulus_bits is not None:
            try:
                rec[Key.MASKED_PARAMETERS] = check_masked(rec[Key.MASKED_PARAMETERS], self.round_modulus_bits,
                                                          self._expected_k())
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


def _weight_sum(state) -> int:
    """What the unmasked weight entry must be: the sum over the clients whose masked vectors were
    summed of Flower's client weight ``round(num_examples / max_weight * Q)`` (-1 if a count is not a
    finite number)."""
    total = 0
    for _, fitres in state.legacy_results:
        n = fitres.num_examples
        if isinstance(n, bool) or not isinstance(n, (int, float, np.integer, np.floating)) or not np.isfinite(n):
            return -1
        total += round(float(n) / state.max_weight * state.quantization_range)
    return total


@contextmanager
def _checking_weight_sum(expected: int, mod_range: int):
    """While Flower's unmask stage runs, check the unmasked weight sum (the first entry, which Flower's
    ``factor_extract`` takes off the sum) against ``expected``; raise `_WeightMismatch` before
    the sum reaches the strategy. Flower 1.42 offers no hook there: its module's ``factor_extract``
    is wrapped for the duration of the call (a test checks that it is still called)."""
    original = _flower_workflow.factor_extract

    def checked(parameters):
        weight, rest = original(parameters)
        if int(weight) != expected:
            raise _WeightMismatch(
                f"the unmasked weight sum is {int(weight)} (modulo 2**{mod_range.bit_length() - 1}) but the "
                f"clients' reported num-examples give {expected}: a client masked another weight than it reported "
                "(inflated, zero or negative), which would skew the mean")
        return weight, rest

    _flower_workflow.factor_extract = checked
    try:
        yield
    finally:
        _flower_workflow.factor_extract = original
