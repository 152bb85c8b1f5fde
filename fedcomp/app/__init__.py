"""The reference Flower apps built on the library: the ServerApp (``server_app``, with the SecAgg+
path in ``secagg_server_app``), the ClientApps (``client_app``, ``lora_client_app``), and what the
server writes (``results``, ``checkpoint``, ``strategy_record``) and prints (``console``,
``startup``).

The repository's ``pyproject.toml`` names them through the app bundle's entry points
(``fedcomp_app.server_app:app``, ``fedcomp_app.client_app:app``); ``fedcomp.app.server_app:app`` and
``fedcomp.app.client_app:app`` work as components too where fedcomp travels in the bundle.
"""
