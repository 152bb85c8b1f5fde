"""fedcomp.util.validate.closest_hint: the one suggestion for a misspelt run-config key or codec parameter."""

import pytest

import fedcomp.compression as fc
from fedcomp.util.validate import closest_hint


@pytest.mark.parametrize(("name", "hint"), [
    ("DENSITY", "did you mean 'density'?"), ("Density", "did you mean 'density'?"),
    ("Value_Dtype", "did you mean 'value_dtype'?"), ("densty", "did you mean 'density'?"),
    ("colour", "no similar parameter"), ("", "no similar parameter")])
def test_the_closest_name_is_found_whatever_the_case(name, hint):
    """Attack finding: a hurried user's 'DENSITY' or 'Density' got 'no similar parameter' (difflib
    compares case-sensitively); the hint names the valid spelling."""
    assert closest_hint(name, {"density", "value_dtype"}, "parameter") == hint


def test_a_capitalised_codec_parameter_names_the_valid_one():
    with pytest.raises(ValueError) as err:
        fc.get_compressor("stc", DENSITY=0.1)
    assert str(err.value) == ("compressor 'stc' has no parameter 'DENSITY'; did you mean 'density'? "
                              "(its parameters: ['density'])")
