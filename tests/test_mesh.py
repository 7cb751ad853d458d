"""Mesh validation happens before anything starts: no processes, clear errors."""

import re

import pytest

from sharddbg.cluster.mesh import MeshSpec, resolve_mesh
from sharddbg.errors import MeshError


@pytest.mark.parametrize("n, mesh, expected", [
    (4, None, (1, 4)),
    (4, {"ddp": 1, "domain": 4}, (1, 4)),
    (4, "ddp=2,domain=2", (2, 2)),
    (4, "ddp=2", (2, 2)),
    (8, {"domain": 2}, (4, 2)),
    (None, "ddp=2,domain=3", (2, 3)),
    (4, (1, 4), (1, 4)),
    (6, {"ddp": -1, "domain": 3}, (2, 3)),
])
def test_valid_meshes(n, mesh, expected):
    spec = resolve_mesh(n, mesh)
    assert spec.shape == expected
    assert spec.size == expected[0] * expected[1]


@pytest.mark.parametrize("n, mesh, fragment", [
    (6, "ddp=4,domain=2", "has 8 ranks but the cluster has n=6"),
    (4, {"ddp": 1, "domain": 0}, "must be at least 1"),
    (4, "ddp=1,domain=2.5", "positive integer"),
    (4, {"ddp": 1, "domain": 2.5}, "positive integer"),
    (4, "ddp=one", "positive integer"),
    (4, "ddp=1,depth=4", "unknown mesh axis"),
    (4, "ddp:1", "NAME=SIZE"),
    (6, {"domain": 4}, "cannot be split into domain groups of 4"),
    (6, {"ddp": 4}, "cannot be split into ddp=4 groups"),
    (0, None, "positive integer"),
    (None, "ddp=2", "give the number of ranks"),
    (None, {"ddp": -1, "domain": -1}, "gives both axes as -1 (inferred), but at most one axis may be -1"),
    (4, "ddp=-1,domain=-1", "gives both axes as -1 (inferred), but at most one axis may be -1"),
    (None, {"ddp": -1, "domain": 4}, "the mesh leaves ddp to be inferred, but the number of ranks is not given"),
    (4, "ddp=1,domain=4,ddp=2", "mesh 'ddp=1,domain=4,ddp=2' gives axis 'ddp' twice (ddp=1 and ddp=2)"),
    (4, " domain=4, ddp=1 ,domain =4", "gives axis 'domain' twice (domain=4 and domain=4)"),
])
def test_invalid_meshes_name_the_problem(n, mesh, fragment):
    with pytest.raises(MeshError, match=re.escape(fragment)):
        resolve_mesh(n, mesh)


def test_bad_mesh_fails_before_any_process_starts():
    import psutil

    import sharddbg

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(MeshError):
        sharddbg.Cluster(n=6, mesh="ddp=4,domain=2")
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def test_coordinates_and_domain_groups():
    spec = MeshSpec(2, 2)
    assert [spec.coordinate(r) for r in range(4)] == [
        {"ddp": 0, "domain": 0}, {"ddp": 0, "domain": 1}, {"ddp": 1, "domain": 0}, {"ddp": 1, "domain": 1}]
    assert spec.domain_group(3) == [2, 3]
