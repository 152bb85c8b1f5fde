"""Run-config parsing and validation (Flower-free).

Every key of ``[tool.flwr.app.config]`` is read here, checked for type and range, and
turned into plain dataclasses. Errors name the key and its allowed range, e.g.
``ValueError: run config 'density' must be in (0, 1], got 1.5``.

- :mod:`.keys`: which keys exist, gathered from the one declaration of each key
  (:class:`fedcomp.util.declared_key.Key`); an unknown key is refused with the closest valid
  name; :func:`reference_table` renders them all as markdown.
- :mod:`.app_keys`: the declarations of the app's own keys.
- :mod:`.codec`: :class:`CodecConfig`, the codec keys (their defaults are its fields).
- :mod:`.app`: :class:`AppConfig`, every other key of the ServerApp and ClientApp.
"""

from fedcomp.config.app import DP_MODES, AppConfig
from fedcomp.config.codec import (
           CODEC_DEFAULTS,
           DENSITY_SCHEDULES,
           SPARSE_CODECS,
           TENSOR_ONLY_CODECS,
           CodecConfig,
           parse_layer_codecs,
)
from fedcomp.config.keys import APP_KEYS, KEYS, check_known_keys, reference_table, run_config_keys, unknown_key_message

__all__ = ["APP_KEYS", "CODEC_DEFAULTS", "DENSITY_SCHEDULES", "DP_MODES", "KEYS", "SPARSE_CODECS", "TENSOR_ONLY_CODECS",
           "AppConfig", "CodecConfig", "check_known_keys", "parse_layer_codecs", "reference_table", "run_config_keys",
           "unknown_key_message"]
