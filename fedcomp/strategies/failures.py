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
  the node's container confirms it later through its ``oom_kill`` count (:mod:`fedcomp.device`,
  :func:`oom_confirmations`);
* the node went away (5) or the reply was lost (4): the SuperLink answers, from its own node id (1),
  so the failed client is found through the message the reply answers.
"""

from __future__ import annotations

from flwr.app import Message

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
#: Longest part of a client-supplied error text kept (untrusted input).
MAX_REASON_CHARS = 500


def failed_client(reply: Message, sent_to: dict[str, int]) -> dict:
    """One failed client from an error reply.

    Parameters
    ----------
    reply : Message
        A reply with ``has_error()``.
    sent_to : dict
        Message id -> destination node id of the round's train messages: the SuperLink answers for a
        node that went away from its own node id, the node is the one the answered message went to.

    Returns
    -------
    dict
        ``{"node": int, "code": int, "error": str (Flower's code name), "reason": str}``.
    """
    code = int(reply.error.code)
    flower_reason = (reply.error.reason or "")[:MAX_REASON_CHARS]
    node = sent_to.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
    if code == CLIENT_APP_CRASHED:
        reason = f"{CRASHED_REASON} (Flower: {flower_reason!r})"
    elif code in (4, 5):
        reason = f"{GONE_REASON} (Flower: {flower_reason!r})"
    else:
        reason = flower_reason or "no reason given"
    return {"node": int(node), "code": code, "error": FLOWER_ERROR_CODES.get(code, "UNKNOWN"), "reason": reason}


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
