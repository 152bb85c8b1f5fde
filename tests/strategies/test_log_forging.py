"""A client cannot forge server log lines or flood the log through the names of its Arrays: every
client-supplied string in a "rejected reply" warning is escaped to one line and capped."""

import logging

from flwr.app import Array

from fedcomp.strategies import CompressedStrategy
from tests.messages import weights

from .helpers import compressed_reply, fedavg, setup

FORGED = "numpy.ndarray\nINFO :      fedcomp  final accuracy 0.99\x1b[31m"


def _rejected_line(caplog, forge) -> str:
    g, t = weights(0), weights(1)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    reply = compressed_reply(g, t, 1)
    rec = reply.content.array_records[next(iter(reply.content.array_records))]
    for key in forge(list(rec.keys())):
        old = rec[key]
        rec[key] = Array(dtype=old.dtype, shape=old.shape, stype=FORGED + "y" * 100_000, data=old.data)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, _ = s.aggregate_train(1, [reply])
        metrics = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert metrics["rejected-replies"] == 1
    (line,) = [r.getMessage() for r in caplog.records if "rejected reply" in r.getMessage()]
    return line


def test_a_forged_stype_among_payloads_is_escaped_and_capped(caplog):
    line = _rejected_line(caplog, lambda keys: keys[:1])
    shown = "numpy.ndarray\\nINFO :      fedcomp  final accuracy 0.99\\x1b[31m" + "y" * (80 - len(FORGED))
    assert line == (f"round 1: rejected reply from node 1: 'w' is a dense '{shown}' array, not a fedcomp payload: "
                    "add compression_mod as the FIRST mod of the ClientApp (mods=[compression_mod, ...])")


def test_a_forged_stype_on_every_array_is_one_bounded_line(caplog):
    line = _rejected_line(caplog, lambda keys: keys)  # a "dense" reply: Flower's own error quotes the stype
    assert "\n" not in line and "\x1b" not in line
    assert line.startswith("round 1: rejected reply from node 1: dense reply 'w' is not numpy data (TypeError: ")
    assert "numpy.ndarray\\nINFO :      fedcomp  final accuracy 0.99\\x1b[31myyy" in line
    # 1000 characters of the refusal, two of them escaped (\n: 2 characters, \x1b: 4)
    assert len(line) == len("round 1: rejected reply from node 1: ") + 1000 + 1 + 3


def test_printable_escapes_controls_and_keeps_the_first_limit_characters():
    from fedcomp.strategies.failures import printable

    assert printable("a\nb\x1b[0m\u2028c\u00e9", 100) == "a\\nb\\x1b[0m\\u2028c\u00e9"
    assert printable("x" * 10 + "\n", 10) == "x" * 10
    assert printable(ValueError("bad\rvalue")) == "bad\\rvalue"
