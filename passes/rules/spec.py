"""OpSpec: an op described for one mesh axis in einsum-like notation, and its expansion.

Notation. ``"bsk,nk,n->bsn"`` names the dims of each tensor input (before ``->``) and each
output (after it), one letter per dim; inputs and outputs are separated by commas, and
``_`` marks a dim that may never be sharded (a softmax dim, a broadcast size-1 dim, the
second dim of a reshape group). For one mesh axis a spec yields these options:

* everything ``Replicate``;
* for each letter in an output: ``Shard`` on that dim of every tensor that has the letter
  (the others ``Replicate``);
* for each letter only in inputs (contracted): ``Shard`` on the inputs that have it, and the
  outputs ``Partial(contract)``; inputs listed in ``additive`` (a bias added after the
  contraction) are then ``Partial`` too. ``contract=None`` forbids this;
* for each set in ``linear``: those inputs ``Partial``, the others ``Replicate``, outputs
  ``Partial`` (the op is linear in that set jointly: ``add`` is linear in {x, y}, ``mm`` in
  {a} and in {b} separately). Single-input linear ops also pass ``Partial(avg)`` through.

:func:`expand` takes the product of the per-axis options over the mesh axes and drops every
combination whose sharded dims do not divide evenly, or that puts ``Partial`` on a tensor that
is not floating point. This is how one rule of a few lines covers 1-, 2- and 3-axis meshes.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.mesh import MeshSpec
from autopar.strategy import Layout, Strategy, placement_code

__all__ = ["OpSpec", "REPLICATED", "AxisOption", "TensorInfo", "axis_options", "expand", "elementwise_spec",
           "without_algorithms"]

AxisOption = tuple[tuple[Placement, ...], tuple[Placement, ...]]  # (input placements, output placements)


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    floating: bool


@dataclass(frozen=True)
class OpSpec:
    """One op on one mesh axis. See the module docstring for the notation."""

    einsum: str
    linear: tuple[frozenset[int], ...] = ()
    contract: str | None = "sum"
    additive: frozenset[int] = frozenset()
    # Index of the positional argument that holds the output's size list (view, expand):
    # the lowering and the validation divide it by the output's shard counts per rank.
    shape_arg: int | None = None
    # Options that the notation cannot express, added as they are.
    extra: tuple[AxisOption, ...] = field(default=())
    # Options the op itself cannot run on local pieces but a runtime algorithm can (ring
    # attention: Q, K and V all split on the sequence). At most one mesh axis takes one; the
    # lowering calls the algorithm, and its own multi-process test (not ``passes.validate``,
    # which runs the op on each piece) checks it against the unsharded op.
    algorithm: tuple[AxisOption, ...] = field(default=())

    def parsed(self, n_in: int, n_out: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Dims per input and per output. An empty side is one 0-d tensor or none, as the op has."""
        lhs, _, rhs = self.einsum.partition("->")
        ins = tuple(lhs.split(",")) if lhs or n_in == 1 else ()
        outs = tuple(rhs.split(",")) if rhs or n_out == 1 else ()
        return ins, outs


# An op that runs only on whole tensors: every input and output Replicate, on any mesh.
REPLICATED = OpSpec("*")


def _shard(dims: str, letter: str) -> Placement:
    return Shard(dims.index(letter)) if letter in dims else Replicate()


@functools.lru_cache(maxsize=4096)
def axis_options(spec: OpSpec, n_in: int, n_out: int) -> tuple[AxisOption, ...]:
    """Every valid (input placements, output placements) of ``spec`` on one mesh axis."""
    ins, outs = spec.parsed(n_in, n_out)
    n_in = len(ins)
    options: list[AxisOption] = [(tuple(Replicate() for _ in ins), tuple(Replicate() for _ in outs))]
    out_letters = {c for o in outs for c in o if c != "_"}
    in_letters = {c for i in ins for c in i if c != "_"}
    for letter in sorted(out_letters):
        options.append((tuple(_shard(i, letter) for i in ins), tuple(_shard(o, letter) for o in outs)))
    if spec.contract is not None:
        partial = Partial(spec.contract)
        for letter in sorted(in_letters - out_letters):
            in_pl = tuple(
                _shard(d, letter) if letter in d else (partial if k in spec.additive else Replicate())
                for k, d in enumerate(ins)
            )
            options.append((in_pl, tuple(partial for _ in outs)))
    for group in spec.linear:
        ops = ("sum", "avg") if n_in == 1 else ("sum",)
        for op in ops:
            options.append(
                (tuple(Partial(op) if k in group else Replicate() for k in range(n_in)),
                 tuple(Partial(op) for _ in outs))
            )
    options.extend(spec.extra)
    options = [o for o in dict.fromkeys(options) if o not in spec.algorithm]
    return tuple(options) + tuple(dict.fromkeys(spec.algorithm))


@functools.lru_cache(maxsize=4096)
def _axis_option_codes(spec: OpSpec, n_in: int, n_out: int) -> tuple:
    """``axis_options`` with each placement's code beside it (see ``autopar.strategy``)."""
    return tuple((tuple((p, placement_code(p)) for p in ins), tuple((p, placement_code(p)) for p in outs))
                 for ins, outs in axis_options(spec, n_in, n_out))


_OK: dict = {}


def _ok(layout: Layout, info: TensorInfo, mesh: MeshSpec) -> bool:
    key = (layout.codes, info.shape, info.floating, mesh.sizes)
    ok = _OK.get(key)
    if ok is None:
        if len(_OK) > 100_000:
            _OK.clear()
        ok = _OK[key] = not (layout.has_partial and not info.floating) and layout.divides(mesh, info.shape)
    return ok


def _layout(pairs) -> Layout:
    codes = tuple([c for _, c in pairs])
    return Layout.interned_by_codes(codes) or Layout.interned(tuple([p for p, _ in pairs]), codes)


def expand(spec: OpSpec, inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo],
           mesh: MeshSpec) -> list[Strategy]:
    """All strategies of ``spec`` on ``mesh``: the product of per-axis options, pruned."""
    if spec is REPLICATED or spec.einsum == "*":
        rep = Layout.replicated(mesh.ndim)
        return [Strategy(tuple(rep for _ in inputs), tuple(rep for _ in outputs))]
    ins, outs = spec.parsed(len(inputs), len(outputs))
    if len(ins) != len(inputs) or len(outs) != len(outputs):
        raise ValueError(
            f"spec {spec.einsum!r} names {len(ins)} inputs and {len(outs)} outputs, "
            f"but the op has {len(inputs)} tensor inputs and {len(outputs)} tensor outputs"
        )
    for dims, info in zip(ins + outs, list(inputs) + list(outputs)):
        if len(dims) != len(info.shape):
            raise ValueError(f"spec {spec.einsum!r}: {dims!r} names {len(dims)} dims, tensor has shape {info.shape}")
    per_axis = _axis_option_codes(spec, len(inputs), len(outputs))
    first_algorithm = len(per_axis) - len(set(spec.algorithm))
    strategies: dict[Strategy, None] = {}
    for picks in itertools.product(range(len(per_axis)), repeat=mesh.ndim):
        if spec.algorithm and sum(i >= first_algorithm for i in picks) > 1:
            continue  # an algorithm runs over one mesh axis
        combo = [per_axis[i] for i in picks]
        in_layouts = tuple(_layout([opt[0][k] for opt in combo]) for k in range(len(inputs)))
        out_layouts = tuple(_layout([opt[1][k] for opt in combo]) for k in range(len(outputs)))
        if all(_ok(l, i, mesh) for l, i in zip(in_layouts, inputs)) and all(
            _ok(l, i, mesh) for l, i in zip(out_layouts, outputs)
        ):
            strategies[Strategy(in_layouts, out_layouts)] = None
    return list(strategies)


def without_algorithms(spec: OpSpec) -> OpSpec:
    """``spec`` with only the options the op runs on local pieces itself."""
    if not spec.algorithm:
        return spec
    from dataclasses import replace

    return replace(spec, algorithm=())


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def elementwise_spec(in_shapes: Sequence[Sequence[int]], out_shape: Sequence[int], n_outputs: int = 1) -> str:
    """Einsum of a broadcasting elementwise op: a dim an input broadcasts (size 1 against a
    larger output dim) is ``_`` for that input, so it stays whole while the output is sharded."""
    nd = len(out_shape)
    out = _LETTERS[:nd]
    parts = []
    for shape in in_shapes:
        offset = nd - len(shape)
        parts.append("".join(
            "_" if (s == 1 and out_shape[offset + k] != 1) else out[offset + k] for k, s in enumerate(shape)
        ))
    return ",".join(parts) + "->" + ",".join([out] * n_outputs)
