"""The concerns of CompressedStrategy: built in one place (`composition.compose`), in a fixed calling
order, each configured by its object, checked against each other once."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg, FedMedian

from fedcomp.download.round_hook import DenseDownload, DownloadHook
from fedcomp.privacy import ClientLevelDP, LocalDP
from fedcomp.protocol.round_hooks import RoundHook
from fedcomp.strategies import Admission, CompressedStrategy, Download, PoissonSampling, Privacy
from fedcomp.strategies.composition import CONCERN_SETTINGS
from fedcomp.strategies.ef21_aggregate import EF21Hook


def _kinds(strategy):
    return [type(h) for h in strategy.hooks]


def test_the_hooks_run_in_the_documented_order():
    s = CompressedStrategy(FedAvg(), downstream="stc", sampling=PoissonSampling(0.5, 1))
    assert _kinds(s) == [Admission, Privacy, PoissonSampling, DownloadHook]
    s = CompressedStrategy(FedAvg(), error_feedback="ef21", downstream="stc")
    assert _kinds(s) == [Admission, Privacy, DownloadHook, EF21Hook]
    assert all(isinstance(h, RoundHook) for h in s.hooks)


def test_defaults_build_one_object_per_concern():
    s = CompressedStrategy(FedAvg(), compressor="sign")
    assert _kinds(s) == [Admission, Privacy, DownloadHook]
    assert s.download == Download("sign") and s.downstream.compressor == "sign"  # the library's "auto"
    assert s.admission.max_num_examples == 10**9 and s.privacy.client_dp is None and s.sampling is None


@pytest.mark.parametrize(("kwargs", "codec", "density"), [
    ({}, "stc", 0.05),  # the default codec, STC at 0.01: STC at five times the density
    ({"compressor": "topk", "density": 0.05}, "stc", 0.25),
    ({"compressor": "topk", "density": 0.1}, "int8", None),  # STC at half the entries: int8 instead
    ({"compressor": "randomk", "density": 0.5}, "int8", None),
    ({"compressor": "randsign"}, "sign", None),
    ({"compressor": "qsgd"}, "int8", None),
    ({"compressor": "powersgd"}, "int8", None),
    ({"compressor": "fp16"}, "int8", None),
    ({"downstream": Download(density=0.2)}, "stc", 0.2),  # a density given is kept
])
def test_auto_download_is_the_upload_codecs_counterpart(kwargs, codec, density):
    s = CompressedStrategy(FedAvg(), **kwargs)
    assert (s.download.codec, s.download.density) == (codec, density)
    assert s.downstream.compressor == codec and s.downstream.density == density


@pytest.mark.parametrize("kwargs", [{"compressor": "none"}, {"privacy": Privacy(local_dp=LocalDP(1.0, 1.0))}])
def test_auto_download_is_dense_where_a_compressed_one_cannot_apply(kwargs):
    s = CompressedStrategy(FedAvg(), **kwargs)
    assert s.download.codec == "none" and s.downstream is None and DenseDownload in _kinds(s)


def test_auto_download_is_dense_for_strategies_that_need_every_reply():
    s = CompressedStrategy(FedMedian(), compressor="sign")
    assert s.download.codec == "none" and s.downstream is None


def test_a_string_download_is_its_codec_and_a_download_object_keeps_its_settings():
    assert CompressedStrategy(FedAvg(), downstream="fp16").download == Download("fp16")
    d = Download("stc", density=0.05, catchup="exact", max_copies=4)
    s = CompressedStrategy(FedAvg(), downstream=d)
    assert s.download is d and s.downstream.density == 0.05 and s.downstream.exact_catchup


@pytest.mark.parametrize("name", sorted(CONCERN_SETTINGS))
def test_every_setting_of_a_concern_passed_flat_is_refused_naming_its_object(name):
    with pytest.raises(TypeError, match=rf"'{name}' is a setting of its concern: pass .*=\w+\("):
        CompressedStrategy(FedAvg(), **{name: 1})


@pytest.mark.parametrize("name", sorted(set(CONCERN_SETTINGS) - {"client_dp", "local_dp", "max_epsilon",
                                                                  "max_num_examples", "require_compression"}))
def test_a_setting_of_a_concern_set_as_an_attribute_is_refused_naming_its_object(name):
    s = CompressedStrategy(FedAvg())
    with pytest.raises(AttributeError, match=rf"'{name}': it is a setting of one of its concerns"):
        setattr(s, name, 1)


@pytest.mark.parametrize("arg, value", [("privacy", ClientLevelDP(1.0, 1.0)), ("admission", 5),
                                        ("sampling", 0.5), ("downstream", 3)])
def test_a_concern_of_the_wrong_type_is_refused_naming_the_argument(arg, value):
    with pytest.raises((TypeError, ValueError), match=arg):
        CompressedStrategy(FedAvg(), **{arg: value})


@pytest.mark.parametrize("download, privacy, error_feedback, why", [
    (Download("none", correction=1.0), None, True, "the download is dense"),
    (Download("stc", correction=1.0), Privacy(client_dp=ClientLevelDP(1.0, 1.0)), True, "client-level DP"),
    (Download("stc", correction=1.0), None, "ef21", "EF21"),
])
def test_the_correction_is_refused_where_another_concern_rules_it_out(download, privacy, error_feedback, why):
    with pytest.raises(ValueError, match=rf"downstream correction = 1\.0 cannot apply: .*{why}"):
        CompressedStrategy(FedAvg(), error_feedback=error_feedback, downstream=download, privacy=privacy)


def test_ef21_is_refused_with_client_level_dp_by_the_composition():
    with pytest.raises(ValueError, match="ef21.*no client_dp"):
        CompressedStrategy(FedAvg(), error_feedback="ef21", privacy=Privacy(client_dp=ClientLevelDP(1.0, 1.0)))


@pytest.mark.parametrize("field, value", [("density", 1.5), ("density", np.float64(0.0)), ("catchup", "dense"),
                                          ("max_copies", float("inf")), ("correction", 2.0), ("codec", "zip")])
def test_bad_download_settings_are_refused_by_the_download_naming_them(field, value):
    with pytest.raises(ValueError, match="downstream"):
        Download(**{"codec": "stc", field: value})


def test_the_privacy_hook_keeps_its_checkpoint_keys():
    s = CompressedStrategy(FedAvg(), privacy=Privacy(client_dp=ClientLevelDP(1.0, 1.0), max_epsilon=8.0))
    state = s.state_dict()
    assert set(state) == {"privacy", "optimizer", "int-remainders", "half-remainders", "ef21", "ef21-folded"}
    assert state["privacy"]["client-dp-rounds"] == 0 and state["ef21"] == {}


def test_client_level_dp_accounted_at_a_rate_the_run_does_not_sample_at_is_refused():
    dp = ClientLevelDP(1.0, 1.0, sample_rate=0.1)
    with pytest.raises(ValueError, match=r"sample_rate=0.1.*no PoissonSampling: pass sampling=PoissonSampling\(0.1\)"):
        CompressedStrategy(FedAvg(), privacy=Privacy(client_dp=dp))
    with pytest.raises(ValueError, match=r"PoissonSampling\(0.5\)"):
        CompressedStrategy(FedAvg(), privacy=Privacy(client_dp=dp), sampling=PoissonSampling(0.5))
    s = CompressedStrategy(FedAvg(), privacy=Privacy(client_dp=dp), sampling=PoissonSampling(0.1))
    assert s.poisson_rate == 0.1


@pytest.mark.parametrize("shared", ["privacy", "sampling", "client_dp"])
def test_a_concern_object_serves_one_strategy(shared):
    dp, sampling = ClientLevelDP(1.0, 1.0), PoissonSampling(0.5)
    CompressedStrategy(FedAvg(), privacy=Privacy(client_dp=dp), sampling=sampling)
    again = {"privacy": {"privacy": Privacy()}, "sampling": {"sampling": sampling},
             "client_dp": {"privacy": Privacy(client_dp=dp)}}[shared]
    if shared == "privacy":
        used = Privacy(max_epsilon=3.0)
        CompressedStrategy(FedAvg(), privacy=used)
        again = {"privacy": used}
    with pytest.raises(ValueError, match="already serves another CompressedStrategy"):
        CompressedStrategy(FedAvg(), **again)


@pytest.mark.parametrize("kwargs, match", [
    ({"client_dp": 1.0}, r"client_dp=\.\.\.\) must be a ClientLevelDP"),
    ({"local_dp": ClientLevelDP(1.0, 1.0)}, r"local_dp=\.\.\.\) must be a LocalDP"),
    ({"client_dp": ClientLevelDP(1.0, 1.0), "local_dp": LocalDP(1.0, 1.0)}, "one mode too many"),
    ({"client_dp": ClientLevelDP(1.0, 1e-200)}, "too small for the RDP accountant"),
    ({"max_epsilon": float("nan")}, "max_epsilon"),
])
def test_bad_privacy_settings_are_refused_at_construction(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Privacy(**kwargs)


def test_numpy_numbers_are_accepted_as_the_budget():
    assert Privacy(max_epsilon=np.float32(3.0)).max_epsilon == 3.0 == Privacy(max_epsilon=np.int64(3)).max_epsilon


@pytest.mark.parametrize("rate, seed", [(True, None), ("0.5", None), (None, None), (0.5, "x"), (0.5, -1)])
def test_bad_sampling_settings_are_refused_naming_poisson_sampling(rate, seed):
    with pytest.raises(ValueError, match="PoissonSampling"):
        PoissonSampling(rate, seed)


def test_ef21_refuses_poisson_sampling():
    with pytest.raises(ValueError, match="ef21.*every client in every round: no PoissonSampling"):
        CompressedStrategy(FedAvg(), error_feedback="ef21", sampling=PoissonSampling(0.5))


@pytest.mark.parametrize("kwargs", [{"compressor": "sign"}, {"compressor": "qsgd"}, {"compressor": "none"}])
def test_a_download_density_that_auto_would_ignore_is_refused_naming_the_choice(kwargs):
    """``Download(density=...)`` with ``codec="auto"`` picking a download without density (sign, int8, dense)."""
    with pytest.raises(ValueError, match=r"Download\(density=0.02\) sets a sparse download's density, but "
                                         r"downstream='auto' picks"):
        CompressedStrategy(FedAvg(), downstream=Download(density=0.02), **kwargs)
