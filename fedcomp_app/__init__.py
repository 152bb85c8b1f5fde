"""The Flower app that ``flwr run .`` submits: the only code the app bundle (FAB) carries.

The bundle that the SuperLink stores and every SuperNode fetches once per run holds this package,
``pyproject.toml`` and ``LICENSE`` (``fab-include``), a few kilobytes. The library it runs, fedcomp,
is installed on every machine that runs a ServerApp or a ClientApp, as any Flower app's
dependencies are (``pip install -c constraints.txt .`` from the repository, or the Docker images),
so codec and strategy code does not travel with every run.

A bundle runs only where the installed fedcomp is the release it was built with
(:data:`BUILT_WITH`): importing ``fedcomp_app.server_app`` or ``fedcomp_app.client_app`` elsewhere
raises :class:`ImportError` naming both versions, which Flower reports as the app failing to load.
"""

from __future__ import annotations

#: the fedcomp release this app bundle was written for; equal to ``fedcomp.__version__`` and to
#: ``[project] version`` in ``pyproject.toml`` (a test holds the three together)
BUILT_WITH = "0.1.0"

_INSTALL = ("install fedcomp {want} on this machine: from the fedcomp repository at that release, "
            "`pip install -c constraints.txt .` (the core; add [data,plots,dp] where the ServerApp runs), "
            "or use the fedcomp Docker images")


def require_fedcomp() -> None:
    """Check that the installed fedcomp is the release this bundle was built with.

    Raises
    ------
    ImportError
        fedcomp is not installed in this Python environment, or its ``__version__`` differs from
        :data:`BUILT_WITH`; the message names both versions and how to install the right one.
    """
    try:
        import fedcomp
    except ImportError as exc:
        raise ImportError("this Flower app needs the fedcomp library, which is not installed here: "
                          + _INSTALL.format(want=BUILT_WITH)) from exc
    have = getattr(fedcomp, "__version__", "unknown")
    if have != BUILT_WITH:
        raise ImportError(f"this app bundle was built with fedcomp {BUILT_WITH}, but this machine has fedcomp "
                          f"{have} ({getattr(fedcomp, '__file__', '?')}): " + _INSTALL.format(want=BUILT_WITH))
