"""``fedcomp-simulation``: ``flwr run . --stream`` that checks the run config first and exits
non-zero, with the reason, when the run fails.

``flwr run`` itself exits 0 when the run failed, answers an unknown run-config key with only
``[code: 15] Invalid run configuration.`` (the key is named in the SuperLink's log) and lets a bad
value wait for Ray to start before the ServerApp refuses it. This command:

1. reads the app's ``[tool.flwr.app.config]`` and the ``--run-config`` overrides (Flower's own
   parser), refuses an unknown key naming the closest valid one, and validates every value with
   the ServerApp's own parser (`fedcomp.app.config.AppConfig.from_run_config`, plus the DP-SGD
   keys with ``dp = "dp-sgd"``), before anything is started: exit code 2, one line;
2. runs ``flwr run <app> --stream`` with the simulation size given here
   (``num-supernodes``, one CPU per client) and without runtime dependency installation, and
   forwards its output (without Flower's "default simulated SuperNodes changed from 10 to 2"
   warning, which it prints whatever the size);
3. exits 0 when the ServerApp reported ``results written to``, else 1 and prints the run's last
   ERROR line (the one-line reason, e.g. ``run config 'resume': the codec settings differ ...``).

Run: ``fedcomp-simulation --supernodes 10 --run-config "compressor='sign' num-server-rounds=20"``
(or ``python -m fedcomp.run.simulation``). Other ``flwr run`` arguments go after ``--``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Any

#: Flower lines that say nothing about this run (printed by the simulation before the app loads): a
#: warning about the default size whatever the size is, and how to change the size (given by --supernodes).
NOISE = ("default simulated SuperNodes changed from", "To change federation size, use the following command:",
         "flwr federation simulation-config ")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STOPPED = " (the run stopped; `flwr run` still exits 0)"
_RESULTS = re.compile(r"fedcomp  results written to (.+?) \(metrics\.json")


def app_defaults(app: pathlib.Path) -> dict[str, Any]:
    """The app's ``[tool.flwr.app.config]``, flattened as Flower does.

    Raises
    ------
    ValueError
        No ``pyproject.toml`` in ``app``, or one Flower refuses.
    """
    from flwr.common.config import flatten_dict, get_project_config

    try:
        project = get_project_config(app)
    except FileNotFoundError:
        raise ValueError(f"{app.resolve()} is not a Flower app (no pyproject.toml)") from None
    return flatten_dict(project["tool"]["flwr"]["app"].get("config", {}))


def check_run_config(app: pathlib.Path, overrides: str) -> dict[str, Any]:
    """Fuse ``overrides`` (``--run-config`` text) with the app's defaults and validate the result as
    the ServerApp will, without starting anything.

    Returns
    -------
    dict
        The fused run config.

    Raises
    ------
    ValueError
        One line: an override that does not parse, an unknown key (with the closest valid name),
        or a value the ServerApp would refuse (naming the key and its range).
    """
    from flwr.common.config import parse_config_args

    from fedcomp.app.config import AppConfig
    from fedcomp.app.keys import check_known_keys

    defaults = app_defaults(app)
    try:
        extra = parse_config_args([overrides]) if overrides.strip() else {}
    except Exception as err:  # noqa: BLE001 - Flower raises click's ClickException here, ValueError elsewhere
        msg = getattr(err, "message", None) or str(err)
        raise ValueError(f"--run-config {overrides!r} does not parse: {msg}") from None
    check_known_keys(extra, frozenset(defaults))  # what Flower refuses with "[code: 15]" only
    fused = {**defaults, **extra}
    if _is_fedcomp_app(app):
        cfg = AppConfig.from_run_config(fused)  # refuses a non-bool 'secagg'
        from fedcomp.app.secagg_server_app import check_secagg_config, secagg_requested

        if secagg_requested(fused):
            check_secagg_config(fused)
        if cfg.finetune == "lora":
            from fedcomp.task.lora import check_base_model

            check_base_model(fused["base-model"])
        if cfg.dp == "dp-sgd":
            from fedcomp.privacy.dp_sgd import DPSGDConfig

            DPSGDConfig.from_mapping(fused)
    return fused


def _is_fedcomp_app(app: pathlib.Path) -> bool:
    """Whether ``app`` runs fedcomp's reference ServerApp (through the bundle's ``fedcomp_app`` entry
    point, or ``fedcomp.app`` named directly), whose run config the pre-check can validate."""
    from flwr.common.config import get_project_config

    comps = get_project_config(app)["tool"]["flwr"]["app"].get("components", {})
    return str(comps.get("serverapp", "")).startswith(("fedcomp_app.", "fedcomp."))


def flwr_command(app: pathlib.Path, supernodes: int, overrides: str, extra: list[str]) -> list[str]:
    """The ``flwr run`` command line (``flwr`` next to this Python, else on PATH)."""
    here = pathlib.Path(sys.executable).parent / "flwr"
    flwr = str(here) if here.exists() else (shutil.which("flwr") or "flwr")
    cmd = [flwr, "run", str(app), "--stream", "--federation-config",
           f"num-supernodes={supernodes} client-resources-num-cpus=1"]
    if overrides.strip():
        cmd += ["--run-config", overrides]
    return cmd + extra


def watch(lines, out=None) -> tuple[str | None, str | None]:
    """Forward ``flwr run``'s output (minus `NOISE`) to ``out`` (default: ``sys.stdout`` at the
    call); return (results folder, reason of a failure): fedcomp's own first ERROR line (its one-line
    reason) if any, else Flower's last ERROR line."""
    out = sys.stdout if out is None else out
    results = error = ours = None
    for line in lines:
        plain = _ANSI.sub("", line).rstrip("\n")
        if any(n in plain for n in NOISE):
            continue
        print(line, end="" if line.endswith("\n") else "\n", file=out, flush=True)
        m = _RESULTS.search(plain)
        if m:
            results = m.group(1)
        if plain.lstrip().startswith("ERROR"):
            error = plain.split(":", 1)[1].strip()
            if ours is None and error.startswith("fedcomp  "):
                ours = error.removeprefix("fedcomp  ").replace(_STOPPED, "")
        elif "[code:" in plain:  # Flower's own refusal of the submitted run
            error = plain.strip()
    return results, ours or error


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point ``fedcomp-simulation``; returns the exit code (0 ok, 1 run failed,
    2 refused before starting)."""
    ap = argparse.ArgumentParser(prog="fedcomp-simulation", description=__doc__.splitlines()[0])
    ap.add_argument("--app", default=".", help="Flower app directory (default: the current directory)")
    ap.add_argument("--supernodes", type=int, default=10, help="simulated SuperNodes (one CPU each)")
    ap.add_argument("--run-config", default="", help='overrides, e.g. "compressor=\'sign\' num-server-rounds=20"')
    ap.add_argument("flwr_args", nargs="*", help="more `flwr run` arguments, after --")
    args = ap.parse_args(argv)
    if args.supernodes < 1:
        ap.error("--supernodes must be >= 1")
    app = pathlib.Path(args.app)
    try:
        check_run_config(app, args.run_config)
    except ValueError as err:
        print(f"fedcomp-simulation: {err}; nothing was started", flush=True)
        return 2
    env = {**os.environ}
    env.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    proc = subprocess.Popen(flwr_command(app, args.supernodes, args.run_config, args.flwr_args), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    try:
        results, error = watch(proc.stdout)
    finally:
        proc.wait()
    if results:
        return 0
    reason = error or f"`flwr run` exited with code {proc.returncode} and no results were written"
    print(f"fedcomp-simulation: the run FAILED: {reason}", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
