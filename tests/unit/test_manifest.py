"""A manifest is checked once per tensor list: later versions of the same list reuse it."""

import pytest

from weightsync.buckets import TensorSpec
from weightsync.errors import PlanError
from weightsync.manifest import VersionManifest
from weightsync.wire import ManifestCache, manifest_to_pb

SPECS = (TensorSpec("a", "bfloat16", (4, 8)), TensorSpec("b", "float32", (3,)))


def test_at_gives_the_version_and_keeps_the_tensors():
    first = VersionManifest(1, SPECS)
    assert first.total_bytes == 4 * 8 * 2 + 3 * 4
    later = first.at(7)
    assert (later.version, first.version) == (7, 1)
    assert later.tensors is first.tensors
    assert later.total_bytes == first.total_bytes


@pytest.mark.parametrize("version", [0, -1, 1 << 63])
def test_at_checks_the_version(version):
    with pytest.raises(PlanError, match=f"Manifest.version {version} is out of range"):
        VersionManifest(1, SPECS).at(version)


def test_cache_parses_a_tensor_list_once_per_list():
    cache = ManifestCache()
    one, key_one = cache(manifest_to_pb(VersionManifest(1, SPECS)))
    two, key_two = cache(manifest_to_pb(VersionManifest(2, SPECS)))
    assert (one.version, two.version) == (1, 2)
    assert key_one == key_two and two.tensors is one.tensors
    other, key_other = cache(manifest_to_pb(VersionManifest(3, SPECS[:1])))
    assert key_other != key_one and other.tensors == SPECS[:1]


def test_cache_still_refuses_a_bad_list():
    msg = manifest_to_pb(VersionManifest(1, SPECS))
    msg.tensors.append(msg.tensors[0])
    with pytest.raises(PlanError, match="'a' appears twice"):
        ManifestCache()(msg)
