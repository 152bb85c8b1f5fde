"""The ClientApp component (``fedcomp_app.client_app:app``): fedcomp's reference ClientApp,
:mod:`fedcomp.app.client_app`, from the installed library."""

from fedcomp_app import require_fedcomp

require_fedcomp()

from fedcomp.app.client_app import app  # noqa: E402

__all__ = ["app"]
