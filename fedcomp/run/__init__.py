"""Launchers: ``fedcomp-simulation`` (``simulation``: ``flwr run`` with the run config checked first),
``fedcomp-local-deployment`` (``local_deployment``: a real SuperLink and SuperNodes on this machine)
and an in-process Flower ``Grid`` for tests and benchmarks (``inprocess_grid``)."""
