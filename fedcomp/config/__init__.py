"""Run-config parsing and validation of the library (Flower-free).

The library's keys of ``[tool.flwr.app.config]`` are read here, checked for type and range, and
turned into plain dataclasses. Errors name the key and its allowed range, e.g.
``ValueError: run config 'density' must be in (0, 1], got 1.5``.

- `keys`: which keys the library declares, gathered from the one declaration of each key
  (`fedcomp.util.declared_key.Key`); an unknown key is refused with the closest valid
  name; `reference_table` renders keys as markdown.
- `codec`: `CodecConfig`, the codec keys (their defaults are its fields).
- `secagg`: SecAgg+'s keys; `low_density`, `model_policy`: the "auto" rules of the codec keys (the
  reference app resolves its own keys in one pass: `fedcomp.app.resolve`).

The reference app's own keys and its `AppConfig` are in `fedcomp.app`.
"""

from fedcomp.config.codec import (
           CODEC_DEFAULTS,
           DENSITY_SCHEDULES,
           SPARSE_CODECS,
           TENSOR_ONLY_CODECS,
           CodecConfig,
           parse_layer_codecs,
)
from fedcomp.config.keys import KEYS, check_known_keys, reference_table, run_config_keys, unknown_key_message

__all__ = ["CODEC_DEFAULTS", "DENSITY_SCHEDULES", "KEYS", "SPARSE_CODECS", "TENSOR_ONLY_CODECS", "CodecConfig",
           "check_known_keys", "parse_layer_codecs", "reference_table", "run_config_keys", "unknown_key_message"]
