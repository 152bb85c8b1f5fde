"""An in-process Flower ``Grid``: runs a real ClientApp on N virtual nodes, sequentially.

It drives exactly the code a ``flwr run`` federation runs (the ClientApp with its mods, the
strategy's ``start``), without Ray or a SuperLink, so tests and benchmarks can run many
rounds in seconds and can inject faults. Each node keeps its own ``Context`` (and so its
``context.state``, e.g. the error-feedback residual) for the whole run. Uses Flower's
``Grid`` interface (``flwr.serverapp.Grid``).
"""

from __future__ import annotations

import copy
import itertools
import time
from typing import Callable, Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.serverapp import Grid

from fedcomp.protocol.messages import server_round

#: Flower's error code for "ClientApp raised an exception".
CLIENT_APP_RAISED_EXCEPTION = 2


def own_copy(content: RecordDict) -> RecordDict:
    """A deep copy of ``content`` made the way the real transport makes one: serialised to
    Flower's protobuf and parsed back, so no two messages (or a message and its sender) share
    a record, and content the transport could not carry fails here too."""
    return recorddict_from_proto(recorddict_to_proto(content))


def _ensure_task_identity() -> None:
    """Flower builds outgoing Messages from a process-wide task identity; set one if unset."""
    from flwr.supercore.task_identity import TaskIdentity

    try:
        TaskIdentity.run_id  # noqa: B018 - raises RuntimeError when unset
    except RuntimeError:
        TaskIdentity.run_id = 1
        TaskIdentity.node_id = 1
        TaskIdentity.task_id = 0


class InProcessGrid(Grid):
    """Deliver messages to a ClientApp called in this process.

    Parameters
    ----------
    client_app : callable
        A ``flwr.clientapp.ClientApp`` (called as ``client_app(message, context)``).
    num_nodes : int
        Number of virtual SuperNodes; node i gets node config
        ``{"partition-id": i, "num-partitions": num_nodes}`` plus ``node_configs[i]``.
    run_config : dict
        The run config every Context carries.
    node_configs : list of dict, optional
        Extra node config per node (e.g. a codec override).
    fault : callable, optional
        ``fault(round, partition_id) -> str | None``: a reason makes that node's reply an
        error reply (as if its ClientApp raised), None delivers normally.
    """

    def __init__(self, client_app, num_nodes: int, run_config: dict, node_configs: list[dict] | None = None,
                 fault: Callable[[int, int], str | None] | None = None) -> None:
        _ensure_task_identity()
        self.client_app = client_app
        self.node_ids = [1000 + i for i in range(num_nodes)]
        self.contexts = {
            nid: Context(run_id=1, node_id=nid,
                         node_config={"partition-id": i, "num-partitions": num_nodes,
                                      **((node_configs or [{}] * num_nodes)[i])},
                         state=RecordDict(), run_config=dict(run_config))
            for i, nid in enumerate(self.node_ids)
        }
        self.fault = fault
        self._ids = itertools.count(1)
        self.seconds: dict[int, float] = {}
        self._run = None

    # -- Grid interface -----------------------------------------------------------------
    @property
    def run(self):
        """Run information: what ``set_run`` stored, else an object with ``run_id = 1``."""
        if self._run is None:
            import types

            return types.SimpleNamespace(run_id=1)
        return self._run

    def set_run(self, run_id: int) -> None:
        """Accepted for interface compatibility."""
        self._run = run_id

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        """Build a message addressed to ``dst_node_id``."""
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        """The virtual node ids."""
        return list(self.node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # pragma: no cover - not used
        """Not supported: use `send_and_receive`."""
        raise NotImplementedError("InProcessGrid only supports send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # pragma: no cover - not used
        """Not supported: use `send_and_receive`."""
        raise NotImplementedError("InProcessGrid only supports send_and_receive")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Call the ClientApp for every message in turn and return the replies.

        Each message is delivered as its own copy of the content (`own_copy`), and each
        reply comes back as a copy, as over the real transport: a handler that edits its
        incoming records changes nothing another node or the server sees. An exception in the
        ClientApp becomes an error reply (code 2), as in Flower.
        """
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"msg-{next(self._ids)}"
            nid = msg.metadata.dst_node_id
            ctx = self.contexts[nid]
            rnd = server_round(msg)
            reason = self.fault(rnd, ctx.node_config["partition-id"]) if self.fault else None
            t0 = time.perf_counter()
            if reason is not None:
                replies.append(Message(Error(code=CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg))
                continue
            # Strategies may put one RecordDict in every message of a round: each node gets its own.
            delivered = Message(content=own_copy(msg.content), metadata=copy.deepcopy(msg.metadata))
            try:
                reply = self.client_app(delivered, ctx)
                if not reply.has_error():  # the server gets a copy too, not the node's own object
                    reply = Message(content=own_copy(reply.content), metadata=reply.metadata)
            except Exception as exc:  # noqa: BLE001 - mirrors Flower turning exceptions into error replies
                reply = Message(Error(code=CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(exc).__name__}: {exc}"),
                                reply_to=msg)
            self.seconds[nid] = time.perf_counter() - t0
            replies.append(reply)
        return replies
