"""Flower's client-side fixed clipping under every codec: the update the server decodes (what its noise is
calibrated to) has norm <= clipping_norm, whatever the codec's own error does to the clipped update."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping

import fedcomp.compression as fc
from fedcomp.client import compression_mod
from fedcomp.client.update import compress_update
from fedcomp.config import CodecConfig
from fedcomp.protocol.messages import payload_array
from fedcomp.compression.registry import CODECS
from fedcomp.strategies import CompressedStrategy
from fedcomp.strategies.decode import decode_update
from tests.strategies.test_flower_composition import CLIP, N, RecordingFedAvg, client_app, fedavg_kw, run

# powersgd needs error feedback, which client-side clipping refuses
VARIANTS = [(name, {}) for name in sorted(CODECS) if name != "powersgd"] + [
    ("eden", {"unbiased": True}), ("qsgd", {"spacing": "exponential"}), ("qsgd", {"levels": 1}),
    ("topk", {"density": 0.25}), ("randomk", {"density": 0.25})]


@pytest.mark.parametrize("codec,options", VARIANTS, ids=[f"{c}-{o}" if o else c for c, o in VARIANTS])
def test_decoded_update_meets_the_clipping_norm(codec, options):
    inner = RecordingFedAvg(**fedavg_kw())
    dp = DifferentialPrivacyClientSideFixedClipping(inner, noise_multiplier=0.0, clipping_norm=CLIP,
                                                    num_sampled_clients=N)
    s = CompressedStrategy(dp, compressor=codec, error_feedback=False, **options)
    run(s, client_app([compression_mod], [fixedclipping_mod]), rounds=2)
    for rnd in (1, 2):
        assert s.history[rnd]["num-replies"] == N and s.history[rnd]["failed-clients"] == 0
        assert len(inner.norms[rnd]) == N
        assert max(inner.norms[rnd]) <= CLIP * (1 + 1e-6)


def _clipped_pair(clip: float, n: int = 4096):
    g = torch.Generator().manual_seed(0)
    received = {"w": torch.randn(n, generator=g).numpy()}
    delta = torch.randn(n, generator=g, dtype=torch.float64)
    delta *= clip / float(delta.norm())  # exactly at the bound, as Flower's clipping mod leaves a long update
    return received, {"w": (torch.from_numpy(received["w"]).double() + delta).float().numpy()}


@pytest.mark.parametrize("codec,options", [("eden", {"unbiased": True}), ("qsgd", {}), ("int8", {}), ("fp16", {})])
def test_rescaled_update_stays_just_below_the_bound(codec, options):
    """The rescaling shrinks the decoded update to the bound, not below it (within 1e-3 relative)."""
    clip = 0.5
    received, trained = _clipped_pair(clip)
    cfg = CodecConfig.from_kwargs(codec, False, **options)
    payloads, _, _ = compress_update(received, trained, cfg, {}, seed=3, clipping_norm=clip)
    decoded, _ = decode_update(ArrayRecord({k: payload_array(p) for k, p in payloads.items()}), received)
    norm = float(np.linalg.norm(decoded["w"].astype(np.float64) - received["w"]))
    assert clip * (1 - 1e-3) <= norm <= clip * (1 + 1e-6)


def test_a_residual_longer_than_the_bound_fails_the_client_naming_codec_and_bound():
    """With error feedback the residual is sent with the update; scaling the update cannot shorten it."""
    received, trained = _clipped_pair(1.0)
    residuals = {"w": np.full(received["w"].shape, 0.1, np.float32)}  # norm 6.4 > 1
    with pytest.raises(ValueError,
                       match=r"codec 'qsgd': the decoded update has L2 norm .* > clipping_norm 1.0 after 4"):
        compress_update(received, trained, CodecConfig.from_kwargs("qsgd", True), residuals, seed=3, clipping_norm=1.0)


def test_with_error_feedback_the_sent_update_meets_the_bound_or_the_client_fails():
    """Error feedback (the server's check bypassed): what the server decodes never exceeds the bound."""
    received, trained = _clipped_pair(1.0)
    residuals = {"w": np.full(received["w"].shape, 0.001, np.float32)}  # norm 0.064: room is left
    payloads, new_res, _ = compress_update(received, trained, CodecConfig.from_kwargs("qsgd", True), residuals,
                                           seed=3, clipping_norm=1.0)
    decoded, _ = decode_update(ArrayRecord({k: payload_array(p) for k, p in payloads.items()}), received)
    assert float(np.linalg.norm(decoded["w"].astype(np.float64) - received["w"])) <= 1.0
    assert new_res["w"].shape == received["w"].shape


def test_a_bound_the_codec_cannot_meet_is_refused():
    from fedcomp.client import clip_bound

    units = [type("U", (), {"key": "w", "sizes": [4], "shape": (4,)})()]
    fixed = fc.get_compressor("none").compress(torch.ones(4))  # whatever is asked, the same norm-2 payload
    with pytest.raises(ValueError,
                       match=r"codec 'stuck': the decoded update has L2 norm 2 > clipping_norm 1.0 after 4"):
        clip_bound.encode_within_norm(lambda d: {"w": type("R", (), {"payload": fixed})()},
                                      {"w": (torch.ones(4), [4.0])}, units, 1.0, "stuck")
