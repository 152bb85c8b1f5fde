"""PayloadError messages read as one phrase: no word repeated back to back (regression:
"truncated: sign sign bits need ...")."""

import re

import pytest
import torch

import fedcomp.compression as fc


def test_truncated_sign_payload_names_the_field_once():
    payload = fc.get_compressor("sign").compress(torch.randn(1000))
    with pytest.raises(fc.PayloadError) as err:
        fc.decompress(payload[:-10])
    assert str(err.value) == "truncated: sign bits need 125 bytes, 115 left"


@pytest.mark.parametrize("name", sorted(fc.available_compressors()))
def test_no_codec_message_repeats_a_word(name):
    kwargs = {"density": 0.05} if name in ("stc", "topk", "randomk") else {}
    payload = fc.get_compressor(name, **kwargs).compress(torch.randn(4000))
    for cut in (1, len(payload) // 3):
        with pytest.raises(fc.PayloadError) as err:
            fc.decompress(payload[:-cut])
        assert not re.search(r"\b(\w+) \1\b", str(err.value)), str(err.value)
