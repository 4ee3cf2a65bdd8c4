"""MeshSpec, Layout and Strategy: parsing, errors, and their short strings."""

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import Layout, MeshError, MeshSpec, Strategy


def test_mesh_parse_and_str():
    mesh = MeshSpec.parse("dp=2,tp=4")
    assert mesh.axes == ("dp", "tp") and mesh.sizes == (2, 4)
    assert mesh.n_devices == 8 and mesh.size("tp") == 4 and str(mesh) == "dp=2,tp=4"
    assert MeshSpec.parse("dp:2 x tp:4") == mesh
    assert MeshSpec.parse(str(mesh)) == mesh


def test_mesh_errors_name_values_and_fix():
    with pytest.raises(MeshError, match=r"dp\(2\) \* tp\(3\) = 6 != 8 devices.*dp=2,tp=4"):
        MeshSpec.parse("dp=2,tp=3", n_devices=8)
    with pytest.raises(MeshError, match="name=size"):
        MeshSpec.parse("dp=2,tp")
    with pytest.raises(MeshError, match="unique"):
        MeshSpec(("dp", "dp"), (2, 2))
    with pytest.raises(MeshError, match="no axis 'pp'"):
        MeshSpec.parse("dp=2").size("pp")


def test_layout_strings_and_local_shape():
    mesh = MeshSpec.parse("dp=2,tp=4")
    layout = Layout((Shard(0), Shard(1)))
    assert str(layout) == "S(0)S(1)"
    assert str(Layout((Replicate(), Partial()))) == "RP"
    assert str(Layout((Partial("avg"),))) == "P(avg)"
    assert layout.local_shape(mesh, (8, 16)) == (4, 4)
    assert layout.divides(mesh, (8, 16)) and not layout.divides(mesh, (8, 6))
    # Two axes on one dim: the dim is cut into 2 * 4 pieces.
    both = Layout((Shard(0), Shard(0)))
    assert both.local_shape(mesh, (16, 3)) == (2, 3) and not both.divides(mesh, (4, 3))


def test_strategy_str_and_identity():
    r, s0 = Layout((Replicate(),)), Layout((Shard(0),))
    strat = Strategy((s0, r), (s0,))
    assert str(strat) == "S(0), R -> S(0)"
    assert strat == Strategy((s0, r), (s0,))  # cost is not part of identity
    assert str(Strategy((), (r,))) == "-> R"
    with pytest.raises(Exception):
        strat.inputs = ()  # frozen
