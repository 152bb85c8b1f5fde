"""The "auto" defaults of density-schedule and strategy: DGC's warm-up and server
momentum for stc/topk below density 1/400, the plain settings everywhere else, said once in
the server's log."""

import logging
import pathlib
import tomllib

import pytest
from flwr.app import Context, RecordDict

from fedcomp.app.config import AppConfig
from fedcomp.config import CodecConfig
from fedcomp.config.low_density import AUTO_SERVER_LR, AUTO_SERVER_MOMENTUM, LOW_DENSITY, auto_note
from fedcomp.app.server_app import check_same_codec

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def resolved(**rc):
    cfg = AppConfig.from_run_config({k.replace("_", "-"): v for k, v in rc.items()})
    return cfg.codec.density_schedule, cfg.strategy, cfg.server_lr, cfg.server_momentum


def test_pyproject_defaults_are_auto():
    toml = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    assert toml["density-schedule"] == "auto" and toml["strategy"] == "auto"
    assert LOW_DENSITY == 0.0025 and (AUTO_SERVER_LR, AUTO_SERVER_MOMENTUM) == (1.0, 0.5)


@pytest.mark.parametrize("compressor", ["stc", "topk"])
@pytest.mark.parametrize("density", [0.001, 0.0024, 1e-4])
def test_low_density_gets_the_warm_up_and_server_momentum(compressor, density):
    assert resolved(compressor=compressor, density=density) == ("exponential", "fedavgm", 1.0, 0.5)
    codec = AppConfig.from_run_config({"compressor": compressor, "density": density}).codec
    assert codec.for_round(1).density == 0.25 and codec.for_round(100).density == density


@pytest.mark.parametrize("rc", [
    {}, {"density": 0.0025}, {"density": 0.01}, {"compressor": "sign"}, {"compressor": "randomk", "density": 0.001},
    {"compressor": "none"}, {"density": 0.001, "error-feedback": False}, {"density": 0.001, "error-feedback": "ef21"},
])
def test_elsewhere_auto_is_the_plain_setting(rc):
    """1/400 and above (the ResNet accuracy-per-byte rows run at 1/100 and 1/400), other codecs, no or EF21 feedback."""
    assert resolved(**{k.replace("-", "_"): v for k, v in rc.items()}) == ("constant", "fedavg", 0.1, 0.9)
    assert auto_note(rc, AppConfig.from_run_config(rc)) == ""


def test_what_the_user_sets_wins():
    assert resolved(density=0.001, density_schedule="constant", strategy="fedavg") == ("constant", "fedavg", 0.1, 0.9)
    assert resolved(density=0.001, strategy="fedavgm", server_lr=0.3, server_momentum=0.2)[1:] == ("fedavgm", 0.3, 0.2)
    assert resolved(density=0.001, strategy="fedadam")[:2] == ("exponential", "fedadam")
    assert resolved(density=0.001, density_schedule="linear")[0] == "linear"
    assert resolved(density=0.001, warmup_rounds=2)[0] == "constant"  # the user's own warm-up


@pytest.mark.parametrize("rc", [{"momentum-correction": 0.5}, {"dp": "client-level", "error-feedback": False},
                                {"dp": "local", "error-feedback": False}])
def test_no_server_momentum_with_momentum_correction_or_dp(rc):
    """Measured: momentum correction + server momentum 74.7 % (worse than either alone)."""
    assert resolved(density=0.001, **{k.replace("-", "_"): v for k, v in rc.items()})[1] == "fedavg"


def test_python_api_resolves_the_schedule_too():
    assert CodecConfig.from_kwargs("topk", True, density=0.001).density_schedule == "exponential"
    assert CodecConfig().density_schedule == "constant"
    assert CodecConfig(density=0.001).to_mapping()["density-schedule"] == "exponential"


def test_the_note_names_what_auto_chose():
    rc = {"density": 0.001}
    note = auto_note(rc, AppConfig.from_run_config(rc))
    assert note.startswith("stc at density 0.001 (< 0.0025): 'auto' defaults chose density warm-up 0.25 -> 0.001")
    assert "server momentum (fedavgm, server-lr 1, server-momentum 0.5)" in note
    rc = {"density": 0.001, "strategy": "fedavg"}
    assert "server momentum" not in auto_note(rc, AppConfig.from_run_config(rc))


def test_a_checkpoint_of_the_plain_default_resumes_only_with_the_plain_setting():
    """A run that used density-schedule "constant" at 1/1000 (the default before "auto") must
    not resume under the warm-up silently; its checkpoint's "auto" resolves by its own codec."""
    saved = AppConfig.from_run_config({"density": 0.001, "density-schedule": "constant"}).codec.to_mapping()
    check_same_codec(saved, AppConfig.from_run_config({"density": 0.001, "density-schedule": "constant"}))
    with pytest.raises(ValueError, match="'density-schedule' = 'exponential' \\(checkpoint: 'constant'\\)"):
        check_same_codec(saved, AppConfig.from_run_config({"density": 0.001}))
    del saved["density-schedule"]  # a key missing from a checkpoint counts as its default, resolved
    check_same_codec(saved, AppConfig.from_run_config({"density": 0.001}))


def test_a_checkpoint_of_the_old_schedule_rounds_default_resumes_while_nothing_ramps():
    """schedule-rounds' default went from 10 to 30: it does nothing under a constant schedule, so a
    checkpoint written with 10 resumes; under a ramp it changes the densities and is refused."""
    saved = AppConfig.from_run_config({"schedule-rounds": 10}).codec.to_mapping()
    check_same_codec(saved, AppConfig.from_run_config({}))
    saved = AppConfig.from_run_config({"density": 0.001, "schedule-rounds": 10}).codec.to_mapping()
    with pytest.raises(ValueError, match="'schedule-rounds' = 30 \\(checkpoint: 10\\)"):
        check_same_codec(saved, AppConfig.from_run_config({"density": 0.001}))


def test_the_server_says_it_once(tmp_path, caplog):
    from fedcomp.app.client_app import app as client_app
    from fedcomp.app.server_app import main
    from fedcomp.run.inprocess_grid import InProcessGrid

    rc = {"num-server-rounds": 2, "density": 0.001, "results-dir": str(tmp_path), "fraction-evaluate": 0.0}
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    with caplog.at_level(logging.INFO, logger="flwr"):
        main(InProcessGrid(client_app, 2, rc), ctx)
    said = [r for r in caplog.records if "'auto' defaults chose" in r.getMessage()]
    assert len(said) == 1
    ramp = [r for r in caplog.records if "more than num-server-rounds = 2" in r.getMessage()]
    assert len(ramp) == 1 and ramp[0].levelno == logging.WARNING  # the 30-round ramp in a 2-round run: said once
    assert "(density exponential)" in (tmp_path / "metrics.json").read_text()  # the codec recorded as run


def test_the_legacy_wrapper_sends_the_round_s_density():
    """LegacyCompressedStrategy sent the codec without its schedule (an "exponential" schedule,
    explicit or from "auto", was reported but never applied)."""
    from tests.strategies.legacy_helpers import N, LinRegClient, fit_all, make_inner, manager

    from fedcomp.client.numpy_client import CompressedNumPyClient
    from fedcomp.strategies.legacy_strategy import LegacyCompressedStrategy

    seen = []

    class Spy(LinRegClient):
        def fit(self, parameters, config):
            seen.append(config["density"])
            return super().fit(parameters, config)

    s = LegacyCompressedStrategy(make_inner("fedavg"), compressor="topk", density=0.001)
    cm = manager([CompressedNumPyClient(Spy(i)) for i in range(N)])  # the inner strategy waits for N
    params = s.initialize_parameters(cm)
    for rnd in (1, 10, 40):
        fit_all(s, rnd, params, cm)
    assert seen == [0.25] * N + [s.codec.scheduled_density(10)] * N + [0.001] * N and 0.001 < seen[N] < 0.25


def test_a_ramp_longer_than_the_run_is_warned_with_the_last_rounds_density():
    from fedcomp.app.config import AppConfig
    from fedcomp.config.low_density import short_ramp_note

    short = AppConfig.from_run_config({"density": 0.001, "num-server-rounds": 3})
    assert short.codec.density_schedule == "exponential" and short.codec.schedule_rounds == 30
    last = short.codec.scheduled_density(3)
    assert 0.17 < last < 0.18
    assert short_ramp_note(short) == (
        "density-schedule 'exponential' takes schedule-rounds = 30 rounds, more than num-server-rounds = 3: "
        f"the last round sends density {last:.4g}, not 0.001; set schedule-rounds <= num-server-rounds or "
        "density-schedule = \"constant\"")
    assert short_ramp_note(AppConfig.from_run_config({"density": 0.001, "num-server-rounds": 30})) == ""
    assert short_ramp_note(AppConfig.from_run_config({"density": 0.01, "num-server-rounds": 3})) == ""


def test_warmup_rounds_turns_both_auto_defaults_off():
    """'auto' steps aside for the schedule and the strategy alike when the user sets a warm-up codec:
    server momentum was measured only together with DGC's warm-up (was: FedAvgM kept, the ramp dropped)."""
    assert resolved(density=0.001, warmup_rounds=2) == ("constant", "fedavg", 0.1, 0.9)
    assert resolved(density=0.001, warmup_rounds=2, strategy="fedavgm") == ("constant", "fedavgm", 0.1, 0.9)


def test_a_density_start_below_density_is_refused():
    with pytest.raises(ValueError) as err:
        AppConfig.from_run_config({"density": 0.002, "density-start": 0.001})
    assert str(err.value) == (
        "run config 'density-start' (0.001) is below 'density' (0.002): density-schedule 'exponential' falls from "
        "density-start to density over schedule-rounds rounds (DGC's warm-up); set density-start >= density or "
        "density-schedule = \"constant\"")
    with pytest.raises(ValueError, match="density-schedule 'linear' falls"):
        AppConfig.from_run_config({"density": 0.5, "density-schedule": "linear"})  # default start 0.25
    # no ramp, no refusal: the start is unused
    assert AppConfig.from_run_config({"density": 0.5, "density-start": 0.1}).codec.density_schedule == "constant"
    assert AppConfig.from_run_config({"density": 0.5, "density-start": 0.5, "density-schedule": "linear"})


def test_the_short_ramp_warning_counts_the_warm_up_rounds():
    from fedcomp.config.low_density import short_ramp_note

    cfg = AppConfig.from_run_config({"density": 0.001, "warmup-rounds": 2, "density-schedule": "exponential",
                                     "schedule-rounds": 5, "num-server-rounds": 6})
    last = cfg.codec.scheduled_density(6)
    assert cfg.codec.for_round(6).density == last and 0.001 < last < 0.25
    assert short_ramp_note(cfg) == (
        "density-schedule 'exponential' takes warmup-rounds + schedule-rounds = 2 + 5 rounds, more than "
        f"num-server-rounds = 6: the last round sends density {last:.4g}, not 0.001; set schedule-rounds <= "
        "num-server-rounds or density-schedule = \"constant\"")
    whole = AppConfig.from_run_config({"warmup-rounds": 3, "num-server-rounds": 3})
    assert short_ramp_note(whole) == (
        "warmup-rounds = 3 covers all num-server-rounds = 3: every round sends 'none', 'stc' never runs; set "
        "warmup-rounds < num-server-rounds")
    assert short_ramp_note(AppConfig.from_run_config({"density": 0.001, "warmup-rounds": 2, "num-server-rounds": 3,
                                                      "density-schedule": "exponential", "schedule-rounds": 1})) == ""


def test_auto_does_not_override_an_explicit_server_lr_or_momentum():
    """"auto" once replaced server-lr 0.3 / server-momentum 0.0 by 1.0 / 0.5 silently."""
    with pytest.raises(ValueError, match=r"^run config 'strategy' = 'auto' chooses fedavgm with server-lr 1 and "
                                         r"server-momentum 0\.5 for this codec, but the run config sets 'server-lr' = "
                                         r"0\.3 and 'server-momentum' = 0\.0: set 'strategy' = 'fedavgm' to use your "
                                         r"values, or leave server-lr and server-momentum at their defaults$"):
        resolved(density=0.001, server_lr=0.3, server_momentum=0.0)
    assert resolved(density=0.001, strategy="fedavgm", server_lr=0.3, server_momentum=0.0) == \
        ("exponential", "fedavgm", 0.3, 0.0)
    assert resolved(density=0.01, server_lr=0.3) == ("constant", "fedavg", 0.3, 0.9)  # auto -> fedavg: nothing lost
    assert resolved(density=0.001, server_lr=0.1, server_momentum=0.9) == ("exponential", "fedavgm", 1.0, 0.5)
