"""Client-side checks of the SecAgg+ requests a server sends, before Flower's ``secaggplus_mod`` acts.

Flower 1.42's client stage trusts the server's setup and unmask requests. A curious server can

- list a node as both alive and dropped in the unmask request: every neighbour then returns both
  of that node's shares (its mask seed's and its key's), and the server strips every mask off that
  one node's vector;
- set a reconstruction threshold of at most half the shares: it then asks half of a node's
  neighbours for the seed share and the other half for the key share, no client giving both.

`check_request` refuses both (and an unmask request naming this node as dropped, or a node
twice): the client raises, Flower turns that into an error reply, and the round's secrets this
client holds are erased first (`abandon_round`), so a second request of the same round finds
nothing to reveal. Source: Bonawitz et al., CCS 2017 (the unmask request must name disjoint sets);
Bell et al., CCS 2020 (SecAgg+, ``t > n / 2`` against a server lying about dropouts).
"""

from __future__ import annotations

from logging import ERROR

from flwr.app import ConfigRecord, Context, Message
from flwr.common.logger import log
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key, Stage

from fedcomp.config.secagg import allows_split, majority_threshold

#: Keys of Flower's client state that hold other nodes' secret shares of the current round.
_SHARE_STATE_KEYS = ("rd_seed_share_dict:K", "rd_seed_share_dict:V", "sk1_share_dict:K", "sk1_share_dict:V")


class UnsafeRequest(ValueError):
    """A SecAgg+ request that would let the server learn more than the sum; the client refuses it.

    A ``ValueError``, as Flower's ``secaggplus_mod`` raises for a request that breaks the protocol; a
    request missing a key is also a ``KeyError`` (`MissingRequestKey`) and one with a value of
    the wrong type also a ``TypeError`` (`MalformedRequest`), as Flower raises for those, so
    code written against Flower's exceptions catches fedcomp's refusals too.
    """


class MissingRequestKey(UnsafeRequest, KeyError):
    """A SecAgg+ request without a key the client needs (a ``KeyError``, as in Flower's ``check_configs``)."""

    __str__ = Exception.__str__  # the message as written, not ``KeyError``'s quoted form


class MalformedRequest(UnsafeRequest, TypeError):
    """A SecAgg+ request with a value of the wrong type (a ``TypeError``, as in Flower's ``check_configs``)."""


def _ints(configs: ConfigRecord, key: str) -> list[int]:
    """The node ids under ``key``.

    Raises
    ------
    MissingRequestKey
        ``key`` is missing.
    MalformedRequest
        Its value is not a list of ints (bools refused).
    """
    if key not in configs:
        raise MissingRequestKey(f"SecAgg+ unmask request: the required key '{key}' is missing")
    value = configs[key]
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise MalformedRequest(f"SecAgg+ unmask request: '{key}' must be a list of node ids, got {value!r}")
    return list(value)


def _check_setup(configs: ConfigRecord) -> None:
    shares, threshold = configs.get(Key.SHARE_NUMBER), configs.get(Key.THRESHOLD)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (shares, threshold)):
        return  # Flower's own check_configs names the wrong type
    if threshold < 1 or allows_split(threshold, shares):
        raise UnsafeRequest(f"SecAgg+ setup asks for threshold {threshold} of {shares} shares: at most half lets the "
                            "server rebuild both secrets of one client from different neighbours; this client needs "
                            f"a threshold of at least {majority_threshold(shares)} (secagg-threshold > half the "
                            "shares)")


def _check_unmask(configs: ConfigRecord, own_id: int) -> None:
    active = _ints(configs, Key.ACTIVE_NODE_ID_LIST)
    dead = _ints(configs, Key.DEAD_NODE_ID_LIST)
    both = sorted(set(active) & set(dead))
    if both:
        raise UnsafeRequest(f"SecAgg+ unmask request lists node(s) {both[:10]} as both alive and dropped: answering "
                            "would hand the server both shares of each and unmask its vector")
    if len(set(active)) != len(active) or len(set(dead)) != len(dead):
        raise UnsafeRequest("SecAgg+ unmask request names a node twice")
    if own_id in dead:
        raise UnsafeRequest(f"SecAgg+ unmask request lists this node ({own_id}) as dropped while asking it to answer")


def abandon_round(ctxt: Context) -> None:
    """Erase the other nodes' shares of the current round from Flower's client state and mark the
    round finished, so that only a new setup stage is accepted (Flower's ``check_stage``)."""
    state = ctxt.state.config_records.get(RECORD_KEY_STATE)
    if state is None:
        return
    for key in _SHARE_STATE_KEYS:
        if key in state:
            state[key] = []
    state["current_stage"] = Stage.UNMASK


def check_request(msg: Message, ctxt: Context) -> None:
    """Refuse a SecAgg+ setup or unmask request that lets the server unmask one client.

    Parameters
    ----------
    msg : Message
        A train message carrying Flower's ``secaggplus_configs`` record (any stage; only setup and
        unmask are checked).
    ctxt : Context
        This node's context (its Flower SecAgg+ state is erased on refusal).

    Raises
    ------
    UnsafeRequest
        Setup: ``2 * threshold <= shares`` or threshold < 1. Unmask: a node both alive and dropped,
        a node named twice, or this node named as dropped; a node-id list missing
        (`MissingRequestKey`, a ``KeyError``) or not a list of ints (`MalformedRequest`,
        a ``TypeError``). Logged at ERROR; the round's shares this client holds are erased before raising.
    """
    configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    if configs is None:
        return
    stage = configs.get(Key.STAGE)
    try:
        if stage == Stage.SETUP:
            _check_setup(configs)
        elif stage == Stage.UNMASK:
            _check_unmask(configs, int(msg.metadata.dst_node_id))
    except UnsafeRequest as exc:
        abandon_round(ctxt)
        log(ERROR, "fedcomp secagg: node %s refuses the server's request: %s", msg.metadata.dst_node_id, exc)
        raise
