"""What a codec is, is declared on the codec: no collection of codec names outside
``fedcomp/compression/``; the registry finds every codec module and answers for each trait."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import fedcomp.compression as fc
from fedcomp.compression.registry import TRAITS

PACKAGE = Path(__file__).resolve().parents[1] / "fedcomp"


def codec_name_collections(root: Path = PACKAGE) -> list[str]:
    """``"path:line: names"`` for each tuple/list/set literal (or set/frozenset of one) holding two or
    more codec names, in the fedcomp modules outside ``compression/``."""
    names = set(fc.available_compressors())
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "compression":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                hits = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
                if len(hits) >= 2:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {hits}")
    return found


def test_no_collection_of_codec_names_outside_compression():
    assert codec_name_collections() == []


def test_the_check_sees_a_literal(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "x.py").write_text('A = ("stc", "topk")\nB = {"fp32", "fp16"}\nC = ["none"]\n')
    assert codec_name_collections(tmp_path) == [f"{tmp_path.name}/config/x.py:1: ['stc', 'topk']"]


def test_every_codec_module_is_registered_without_being_named():
    package = importlib.import_module("fedcomp.compression")
    defined = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"fedcomp.compression.{info.name}")
        defined |= {cls.name for _, cls in inspect.getmembers(module, inspect.isclass)
                    if issubclass(cls, fc.Compressor) and cls.__module__ == module.__name__ and cls.name}
    assert defined == set(fc.available_compressors())
    init = Path(package.__file__).read_text()
    assert not any(f"import {name}" in init or f" {name}," in init for name in ("stc", "topk", "atomo", "powersgd"))


def test_traits_answer_what_the_old_lists_said():
    from fedcomp.config import SPARSE_CODECS, TENSOR_ONLY_CODECS
    from fedcomp.config.low_density import RAMP_CODECS
    from fedcomp.secagg import SECAGG_CODECS

    assert SPARSE_CODECS == fc.codecs_with(sparse=True) == ("stc", "topk", "randomk", "randsign")
    assert RAMP_CODECS == fc.codecs_with(density_ramp=True) == ("stc", "topk")
    assert SECAGG_CODECS == ("randomk", "none")
    assert TENSOR_ONLY_CODECS == ("powersgd", "atomo")
    assert fc.codecs_with(small_tensor=True) == ("none", "fp16", "bf16")
    assert fc.codecs_with(requires_error_feedback=True) == ("powersgd",)
    assert set(fc.codecs_with(seeded=True)) == {"randomk", "qsgd", "int8", "powersgd", "eden", "atomo", "randsign"}
    assert set(fc.codecs_with(sparse=False)) == set(fc.available_compressors()) - set(SPARSE_CODECS)
    with pytest.raises(ValueError, match="unknown codec trait"):
        fc.codecs_with(sprase=True)
    assert set(TRAITS) <= set(dir(fc.Compressor))


def test_every_option_is_a_codec_key_and_every_codec_builds_from_the_config():
    from fedcomp.config import CODEC_DEFAULTS, CodecConfig

    for key, opt in fc.codec_options().items():
        assert CODEC_DEFAULTS[key] == opt.default
    cfg = CodecConfig()
    for name in fc.available_compressors():
        codec = cfg.build(seed=0, compressor=name)
        assert set(fc.CODECS[name].config_keys) <= set(inspect.signature(type(codec)).parameters)


def test_two_codecs_may_not_declare_one_key_differently():
    from fedcomp.compression.options import DENSITY, Option, merge_options

    assert merge_options({"a": (DENSITY,), "b": (DENSITY,)}) == {"density": DENSITY}
    with pytest.raises(ValueError, match="codecs 'a' and 'b' declare run-config key 'density' differently"):
        merge_options({"a": (DENSITY,), "b": (Option("density", "density", float, 0.5),)})
