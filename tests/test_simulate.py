"""`fedcomp-simulation`: the run config is checked before anything starts, a failed run
exits non-zero with its reason, a finished one exits 0."""

import pathlib
import sys

import pytest

from fedcomp.run import simulation as simulate

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def nothing_starts(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(simulate.subprocess, "Popen", refuse)


@pytest.mark.parametrize("overrides,says", [
    ("num-rounds=3", "run config key 'num-rounds' is unknown; did you mean 'num-server-rounds'?"),
    ("densty=0.05", "did you mean 'density'?"),
    ("density=2.0", "run config 'density' must be in (0.0, 1.0], got 2.0"),
    ("dp='dp-sgd' accountant='gdp'", "'accountant'"),
    ("compressor=sign", "does not parse"),  # an unquoted string is not TOML
])
def test_a_bad_run_config_is_refused_before_anything_starts(overrides, says, nothing_starts, capsys):
    assert simulate.main(["--app", str(REPO), "--run-config", overrides]) == 2
    out = capsys.readouterr().out.strip()
    assert out.startswith("fedcomp-simulation: ") and says in out and out.endswith("nothing was started")
    assert "\n" not in out


def test_not_a_flower_app(tmp_path, nothing_starts, capsys):
    assert simulate.main(["--app", str(tmp_path)]) == 2
    assert "is not a Flower app (no pyproject.toml)" in capsys.readouterr().out


FAILED = """Starting local SuperLink on 127.0.0.1:39091...
\x1b[93mWARNING \x1b[0m:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.
\x1b[91mERROR \x1b[0m:     fedcomp  run config 'resume': the codec settings differ from the checkpoint's: \
'compressor' = 'sign' (checkpoint: 'stc') (the run stopped; `flwr run` still exits 0)
\x1b[91mERROR \x1b[0m:     Exit Code: 700
"""
FINISHED = """\x1b[92mINFO \x1b[0m:      Federation `@none/default` (2 simulated SuperNodes)
\x1b[92mINFO \x1b[0m:      To change federation size, use the following command:
\x1b[92mINFO \x1b[0m:      \tflwr federation simulation-config @none/default <superlink> --num-supernodes <N>
\x1b[92mINFO \x1b[0m:      fedcomp  final accuracy 0.3667 after 2 rounds, 0.003 MB uploaded in total
\x1b[92mINFO \x1b[0m:      fedcomp  results written to /tmp/r (metrics.json, plot.png, flower.log)
"""


@pytest.mark.parametrize("output,code", [(FAILED, 1), (FINISHED, 0), ("", 1)])
def test_the_exit_code_says_whether_the_run_wrote_its_results(output, code, monkeypatch, capsys):
    """`flwr run` exits 0 either way; a stand-in prints what it prints."""
    fake = [sys.executable, "-c", f"import sys; sys.stdout.write({output!r})"]
    monkeypatch.setattr(simulate, "flwr_command", lambda *a: fake)
    assert simulate.main(["--app", str(REPO), "--supernodes", "2"]) == code
    out = capsys.readouterr().out
    assert "default simulated SuperNodes changed" not in out  # Flower's noise is not forwarded
    assert "federation size" not in out and "simulation-config" not in out  # --supernodes sets the size
    if output == FINISHED:
        assert out.splitlines()[0] == "\x1b[92mINFO \x1b[0m:      Federation `@none/default` (2 simulated SuperNodes)"
    if output == FAILED:
        assert out.splitlines()[-1] == ("fedcomp-simulation: the run FAILED: run config 'resume': the codec settings "
                                        "differ from the checkpoint's: 'compressor' = 'sign' (checkpoint: 'stc')")
    if output == "":
        assert "exited with code 0 and no results were written" in out


def test_the_flwr_command_carries_the_size_and_overrides():
    cmd = simulate.flwr_command(REPO, 7, "num-server-rounds=2", ["--format", "default"])
    assert cmd[1:4] == ["run", str(REPO), "--stream"]
    assert cmd[4:6] == ["--federation-config", "num-supernodes=7 client-resources-num-cpus=1"]
    assert cmd[6:] == ["--run-config", "num-server-rounds=2", "--format", "default"]


@pytest.mark.parametrize("base,says", [
    ("./nope", "is a relative path: give an absolute one"),
    ("/nonexistent-fedcomp-base", "cannot be loaded: no such directory /nonexistent-fedcomp-base"),
])
def test_a_lora_base_model_that_cannot_load_is_refused_before_anything_starts(base, says, nothing_starts, capsys):
    overrides = f"finetune='lora' dataset='shakespeare' model='transformer' base-model='{base}'"
    assert simulate.main(["--app", str(REPO), "--run-config", overrides]) == 2
    out = capsys.readouterr().out.strip()
    assert out.startswith("fedcomp-simulation: ") and says in out and out.endswith("nothing was started")
    assert "\n" not in out


def test_a_lora_base_model_directory_passes_the_precheck(tmp_path):
    overrides = f"finetune='lora' dataset='shakespeare' model='transformer' base-model='{tmp_path}'"
    fused = simulate.check_run_config(REPO, overrides)
    assert fused["base-model"] == str(tmp_path) and fused["finetune"] == "lora"
