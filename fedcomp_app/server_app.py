"""The ServerApp component (``fedcomp_app.server_app:app``): fedcomp's reference ServerApp,
:mod:`fedcomp.app.server_app`, from the installed library."""

from fedcomp_app import require_fedcomp

require_fedcomp()

from fedcomp.app.server_app import app  # noqa: E402

__all__ = ["app"]
