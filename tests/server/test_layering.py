"""The server side reaches nothing of the client's rooms (what both need lives outside ``client/``)."""

import subprocess
import sys


def test_the_server_app_imports_no_client_module():
    code = ("import sys, fedcomp.server.app, fedcomp.strategies\n"
            "print(sorted(m for m in sys.modules if m.startswith('fedcomp.client')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
