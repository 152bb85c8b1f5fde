"""Why a sampled client sent no update: Flower's error replies, and tasks that got no reply at all,
turned into one record per failed client (its node id, Flower's error code and a reason a person can
act on) for the server's log and ``failures`` in metrics.json.

What Flower 1.42 tells the ServerApp (``flwr.common.constant.ErrorCode``; read from its source):

* the ClientApp raised (code 2) or could not be loaded (1): the reply comes from the node, with the
  exception in the reason;
* the ClientApp process died without replying (code 8, ``"ClientApp stopped responding."``): the
  SuperNode notices that the process's heartbeat stopped (after ~2 x 30 s) and answers for it. Flower
  does not keep the exit status: a process the kernel's out-of-memory killer took (SIGKILL; exit code
  137 in a container) looks exactly like any other crash, so the reason says "likely out of memory";
  the node's container confirms it later through its ``oom_kill`` count (`fedcomp.protocol.device`,
  `oom_confirmations`);
* the node went away (5) or the reply was lost (4): the SuperLink answers, from its own node id (1),
  so the failed client is found through the message the reply answers.

Who sent a reply (Flower 1.42's SuperLink, ``LinkState.store_message_res``, read from its source): a
SuperNode's reply is stored only if its ``src_node_id`` equals the ``dst_node_id`` of the message named by
its ``reply_to_message_id`` (same run), and the ServerApp's grid pulls only replies to messages it pushed.
The SuperLink does not check ``src_node_id`` against the node that pushed the reply (the Fleet API's
``PushMessages`` takes it from the message; SuperNode authentication, when on, authenticates only the
request's ``node_id``). So the two fields agree on a real SuperLink; when they do not (a hostile or
broken transport, a hand-built reply), a failure is charged to ``src_node_id``, the node that says it sent
the reply, never to the node the answered message went to; a sender that was not sampled is charged
nothing (`round_failures`).
"""

from __future__ import annotations

from flwr.app import Message
from flwr.common.constant import SUPERLINK_NODE_ID

#: Flower 1.42's error codes (``flwr.common.constant.ErrorCode``) by name.
FLOWER_ERROR_CODES = {0: "UNKNOWN", 1: "LOAD_CLIENT_APP_EXCEPTION", 2: "CLIENT_APP_RAISED_EXCEPTION",
                      3: "MESSAGE_UNAVAILABLE", 4: "REPLY_MESSAGE_UNAVAILABLE", 5: "NODE_UNAVAILABLE",
                      6: "MOD_FAILED_PRECONDITION", 7: "INVALID_FAB", 8: "CLIENT_APP_CRASHED"}
#: ``ErrorCode.CLIENT_APP_CRASHED``: the ClientApp process ended without a reply.
CLIENT_APP_CRASHED = 8
#: What the log and metrics.json say for a ClientApp that died without replying.
CRASHED_REASON = ("the ClientApp process ended without replying: killed by a signal (SIGKILL, exit code 137 in a "
                  "container) — likely out of memory (the kernel's OOM killer) — or crashed")
#: The same for a SuperNode that went away (5) or a reply that never arrived (4).
GONE_REASON = ("the SuperNode went away before replying (disconnected, stopped, or its container killed — "
               "e.g. out of memory)")
#: A sampled node whose task got no reply at all before the round's timeout.
NO_REPLY_REASON = "no reply before the round's timeout"
#: An error reply from the SuperLink that answers no message this round sent: no node to charge.
UNTRACED_REASON = ("an error reply from the SuperLink answers no train message this round sent: which node it "
                   "stands for is unknown; it is not charged to any node (every sampled node without a reply is "
                   "counted as failed anyway)")
#: An error reply whose sender was not sent a message this round.
STRANGER_REASON = "its sender was not sent a message this round: not charged to any node (one node, one vote)"
#: Longest part of a client-supplied error text kept (untrusted input).
MAX_REASON_CHARS = 500
#: Longest refusal text logged for a rejected reply (server wording around client-supplied names).
MAX_REFUSAL_CHARS = 1000


def printable(text: object, limit: int = MAX_REASON_CHARS) -> str:
    """``str(text)`` made safe for one log line: its first ``limit`` characters, each non-printable
    one (newline, ``\\x1b``, other control and format characters) written as its Python escape, so
    untrusted text can neither forge log lines nor send terminal escapes, and never exceeds
    ``limit`` source characters."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text)[:limit])


def failed_client(reply: Message, sent_to: dict[str, int]) -> dict:
    """One failed client from an error reply, charged to the node that sent it.

    Parameters
    ----------
    reply : Message
        A reply with ``has_error()``.
    sent_to : dict
        Message id -> destination node id of the round's messages: the SuperLink answers for a node
        that went away from its own node id (1); the failed node is then the one the answered message
        went to. A reply from any other node is charged to its ``src_node_id``.

    Returns
    -------
    dict
        ``{"node": int, "code": int, "error": str (Flower's code name), "reason": str}``; ``node`` is
        the SuperLink's id (1) for a SuperLink reply to a message not in ``sent_to``.
    """
    code = int(reply.error.code)
    flower_reason = (reply.error.reason or "")[:MAX_REASON_CHARS]
    src = int(reply.metadata.src_node_id)
    node = sent_to.get(reply.metadata.reply_to_message_id, src) if src == SUPERLINK_NODE_ID else src
    if code == CLIENT_APP_CRASHED:
        reason = f"{CRASHED_REASON} (Flower: {flower_reason!r})"
    elif code in (4, 5):
        reason = f"{GONE_REASON} (Flower: {flower_reason!r})"
    else:
        reason = flower_reason or "no reason given"
    return {"node": int(node), "code": code, "error": FLOWER_ERROR_CODES.get(code, "UNKNOWN"),
            "reason": reason + misaddressed_note(reply, sent_to)}


def misaddressed_note(reply: Message, sent_to: dict[str, int]) -> str:
    """``" (the reply names the message sent to node N: charged to its sender)"`` for a node's reply
    whose ``reply_to_message_id`` names a message sent to another node N; "" otherwise."""
    src = int(reply.metadata.src_node_id)
    named = sent_to.get(reply.metadata.reply_to_message_id)
    if src != SUPERLINK_NODE_ID and named is not None and named != src:
        return f" (the reply names the message sent to node {named}: charged to its sender)"
    return ""


def round_failures(errors: list[Message], sent_to: dict[str, int], sent_nodes: set[int] | None,
                   answered: set[int]) -> tuple[list[tuple[Message, dict]], list[tuple[Message, str]], list[dict]]:
    """The round's failed clients: each sampled node without a reply of its own, counted and named once.

    Parameters
    ----------
    errors : list of Message
        The round's error replies.
    sent_to : dict
        Message id -> destination node id of the round's train messages.
    sent_nodes : set of int or None
        The nodes sent a train message (None: unknown; then every error reply is charged to its
        node and no node counts as silent).
    answered : set of int
        Nodes that sent a reply without error (accepted, rejected or refused: not failed).

    Returns
    -------
    (charged, uncharged, silent)
        ``charged``: ``(reply, failed_client record)`` for the first error reply of each node that
        sent no other reply; ``uncharged``: ``(reply, why)`` for an error reply charged to nobody: from
        the SuperLink for a message this round did not send (`UNTRACED_REASON`), or from a node
        not sampled (`STRANGER_REASON`); a node's further error replies are dropped without a
        word (one node, one failure). ``silent``: `missing_clients` for the sampled nodes left.
    """
    charged, uncharged, seen = [], [], set(answered)
    for reply in errors:
        failure = failed_client(reply, sent_to)
        node = failure["node"]
        if reply.metadata.src_node_id == SUPERLINK_NODE_ID and reply.metadata.reply_to_message_id not in sent_to:
            uncharged.append((reply, UNTRACED_REASON))
        elif sent_nodes is not None and node not in sent_nodes:
            uncharged.append((reply, STRANGER_REASON))
        elif node not in seen:
            seen.add(node)
            charged.append((reply, failure))
    return charged, uncharged, missing_clients(sent_nodes, seen)


def missing_clients(sent_nodes: set[int] | None, replied_nodes: set[int]) -> list[dict]:
    """Sampled nodes with no reply of any kind (the round's timeout passed): one record each,
    ``{"node", "code": -1, "error": "NO_REPLY", "reason"}``, sorted by node id."""
    return [{"node": int(n), "code": -1, "error": "NO_REPLY", "reason": NO_REPLY_REASON}
            for n in sorted((sent_nodes or set()) - replied_nodes)]


def oom_confirmations(last_seen: dict[int, int], stats: list[dict]) -> list[dict]:
    """Nodes whose container's out-of-memory kill count (``client-oom-kills``) went up since the
    server last heard from them: ``{"node", "oom-kills-before", "oom-kills"}`` each. Updates
    ``last_seen`` (node -> count) in place. A node's first report counts from 0, so kills before
    its first successful reply (e.g. its round-1 ClientApp) are reported too."""
    out = []
    for s in stats:
        node, now = s["node"], int(s.get("client-oom-kills", 0))
        before = last_seen.get(node, 0)
        if now > before:
            out.append({"node": node, "oom-kills-before": before, "oom-kills": now})
        last_seen[node] = max(now, before)
    return out
