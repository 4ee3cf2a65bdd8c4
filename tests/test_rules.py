"""The rule registry and the einsum-like expansion over mesh axes."""

import warnings

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar import Layout, MeshSpec, Strategy
from autopar.passes.rules import (OpSpec, RuleError, TensorInfo, axis_options, elementwise_spec, expand, get_rule,
                                  register_rule, temporary_rule)
from autopar.passes.rules.ops_view import reshape_spec

aten = torch.ops.aten


def _strs(strategies):
    return {str(s) for s in strategies}


def test_mm_on_one_axis_has_the_textbook_strategies():
    mesh = MeshSpec.parse("tp=2")
    info = lambda *s: TensorInfo(s, True)  # noqa: E731
    got = _strs(expand(get_rule(aten.mm.default).fn(torch.empty(8, 16), torch.empty(16, 8)),
                       [info(8, 16), info(16, 8)], [info(8, 8)], mesh))
    assert got == {
        "R, R -> R",
        "S(0), R -> S(0)",        # rows of A
        "R, S(1) -> S(1)",        # columns of B (Megatron column parallel)
        "S(1), S(0) -> P",        # contraction (row parallel): partial sums
        "P, R -> P", "R, P -> P",  # linear in each operand
    }


def test_expansion_is_the_product_over_axes_and_drops_what_cannot_divide():
    mesh = MeshSpec.parse("a=2,b=2")
    spec = OpSpec("mk,kn->mn", linear=())
    even = expand(spec, [TensorInfo((8, 8), True), TensorInfo((8, 8), True)], [TensorInfo((8, 8), True)], mesh)
    assert len(even) == 4 * 4  # R, S(m), S(n), S(k)->P on each axis
    odd = expand(spec, [TensorInfo((3, 8), True), TensorInfo((8, 8), True)], [TensorInfo((3, 8), True)], mesh)
    assert all(not isinstance(p, Shard) or p.dim != 0 for s in odd for p in s.outputs[0].placements)
    assert "S(0)S(0), RR -> S(0)S(0)" not in _strs(odd)
    # Both axes may cut the same dim when it divides by 4.
    assert "S(0)S(0), RR -> S(0)S(0)" in _strs(even)


def test_partial_never_lands_on_integer_tensors():
    mesh = MeshSpec.parse("a=2")
    spec = OpSpec("ab->ab", linear=(frozenset({0}),))
    ints = expand(spec, [TensorInfo((8, 8), False)], [TensorInfo((8, 8), False)], mesh)
    assert all(not s.outputs[0].has_partial for s in ints)


def test_elementwise_broadcast_keeps_broadcast_dims_whole():
    assert elementwise_spec([(8, 4, 16), (16,)], (8, 4, 16)) == "abc,c->abc"
    assert elementwise_spec([(8, 1, 16), (8, 4, 1)], (8, 4, 16)) == "a_c,ab_->abc"


def test_reshape_groups_share_the_leading_letter():
    assert reshape_spec((8, 16, 64), (8, 16, 4, 16)) == "abc->abc_"
    assert reshape_spec((8, 16, 4, 16), (8, 16, 64)) == "abc_->abc"
    assert reshape_spec((8, 16, 64), (128, 64)) == "a_b->ab"
    assert reshape_spec((8, 1, 8), (8, 8)) == "a_b->ab"


def test_registry_duplicate_missing_and_temporary():
    with pytest.raises(RuleError, match=r"aten.mm.default is already registered"):
        register_rule(aten.mm.default, samples=lambda: [])(lambda a, b: OpSpec("mk,kn->mn"))
    with pytest.raises(RuleError, match=r"no sharding rule for aten.cholesky.default"):
        get_rule(aten.cholesky.default)
    original = get_rule(aten.mm.default)
    with temporary_rule(aten.mm.default, lambda a, b: OpSpec("**")) as rule:
        assert get_rule(aten.mm.default) is rule
    assert get_rule(aten.mm.default) is original
    with temporary_rule(aten.cholesky.default, lambda x: OpSpec("*")):
        assert get_rule(aten.cholesky.default).op is aten.cholesky.default
    with pytest.raises(RuleError):
        get_rule(aten.cholesky.default)


def test_axis_options_contraction_with_bias_makes_bias_partial():
    # linear: x[..., k] @ w[n, k]^T + b[n]; sharding k gives partial sums, so the bias is
    # added on one piece only (Partial too), never once per rank.
    spec = get_rule(aten.linear.default).fn(torch.empty(8, 16), torch.empty(8, 16), torch.empty(8))
    contracted = [o for o in axis_options(spec, 3, 1) if o[1] == (Partial(),) and isinstance(o[0][0], Shard)]
    assert contracted == [((Shard(1), Shard(1), Partial()), (Partial(),))]
