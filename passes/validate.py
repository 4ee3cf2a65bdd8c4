"""Ground-truth validation of sharding rules.

For every registered rule, every sample input it names, every mesh shape asked for and
every strategy its spec expands to: cut each input into per-rank pieces as the strategy's
input layout says (``Shard`` slices, ``Partial`` splits into random addends), run the op on
each rank's piece under ``LocalTensorMode`` (all ranks simulated in this process), assemble
the outputs from their layouts with DTensor, and compare with the op on the whole inputs.

Run ``python -m autopar.passes.validate`` for a summary of passed rule x placement cases.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.mesh import MeshSpec
from autopar.strategy import Layout, Strategy

from .rules import Rule, expand, get_rule, registered_ops, tensor_info, tensor_leaves, without_algorithms

__all__ = ["Failure", "ValidationReport", "validate_rules", "local_args"]


@dataclass(frozen=True)
class Failure:
    rule: str
    sample: int
    mesh: tuple[int, ...]
    strategy: str
    error: str

    def __str__(self) -> str:
        return f"{self.rule} sample {self.sample} mesh {self.mesh} [{self.strategy}]: {self.error}"


@dataclass
class ValidationReport:
    passed: int = 0
    failures: list[Failure] = field(default_factory=list)
    cases_per_rule: dict[str, int] = field(default_factory=dict)
    rules_without_samples: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.passed} rule x placement cases passed, {len(self.failures)} failed, "
            f"{len(self.cases_per_rule)} ops checked"
            + (f", {len(self.rules_without_samples)} ops without samples" if self.rules_without_samples else "")
        )


def _coords(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
    """``rank``'s coordinates on a mesh of ``shape``, row-major (``torch.unravel_index``'s
    order, in plain integers: through torch it was a quarter of the 3-axis validation's time)."""
    coords = []
    for size in reversed(tuple(shape)):
        rank, c = divmod(rank, size)
        coords.append(c)
    return tuple(reversed(coords))


def _split_local(full: torch.Tensor, layout: Layout, mesh_shape: Sequence[int], gen: torch.Generator):
    """Per-rank pieces of ``full`` in ``layout``: a tensor of shape (*mesh_shape, *local_shape)."""
    pieces = []
    for rank in range(math.prod(mesh_shape)):
        t = full
        for p, size, c in zip(layout.placements, mesh_shape, _coords(rank, mesh_shape)):
            if isinstance(p, Shard):
                t = t.chunk(size, dim=p.dim)[c]
        pieces.append(t)
    stacked = torch.stack(pieces).reshape(*mesh_shape, *pieces[0].shape).clone()
    for axis, (p, size) in enumerate(zip(layout.placements, mesh_shape)):
        if isinstance(p, Partial):
            # Addends that sum (or average) to the value: add zero-mean noise along the axis.
            # Copies on a Replicate axis must stay identical, so the noise is constant along those.
            shape = [1 if isinstance(q, Replicate) else n for q, n in zip(layout.placements, mesh_shape)]
            noise = torch.randn(shape + list(stacked.shape[len(mesh_shape):]), generator=gen, dtype=stacked.dtype)
            noise = noise - noise.mean(dim=axis, keepdim=True)
            stacked = (stacked / size if p.reduce_op == "sum" else stacked) + noise
    return stacked


def local_args(args: Any, kwargs: Any, spec_shape_arg: int | None, out_layout: Layout | None,
               mesh: MeshSpec) -> tuple[Any, Any]:
    """Divide the size-list argument of a shape-taking op (view, expand) by the output's shard
    counts, so each rank asks for its own local shape. -1 entries stay -1."""
    if spec_shape_arg is None or out_layout is None:
        return args, kwargs
    sizes = list(args[spec_shape_arg])
    counts = out_layout.shard_counts(mesh, len(sizes))
    local = [s if s == -1 else s // c for s, c in zip(sizes, counts)]
    return args[:spec_shape_arg] + (local,) + args[spec_shape_arg + 1:], kwargs


def _assemble_check(outs: list[torch.Tensor], expected: list[torch.Tensor], layouts: Sequence[Layout],
                    mesh: MeshSpec, gen) -> str | None:
    """Compare per-rank outputs with the unsharded result: reduce each ``Partial`` axis, then
    each rank must hold exactly its slice of the expected tensor."""
    for i, (o, want, layout) in enumerate(zip(outs, expected, layouts)):
        pieces = [o._local_tensors[r] for r in range(mesh.n_devices)]
        if len({tuple(p.shape) for p in pieces}) != 1:
            return f"output {i}: ranks disagree on the local shape"
        got = torch.stack(pieces).reshape(*mesh.sizes, *pieces[0].shape)
        for axis, p in enumerate(layout.placements):
            if isinstance(p, Partial):
                reduce = got.sum if p.reduce_op == "sum" else got.mean
                got = reduce(dim=axis, keepdim=True).expand(got.shape)
        want_pieces = _split_local(want, Layout(tuple(
            Replicate() if isinstance(p, Partial) else p for p in layout.placements)), mesh.sizes, gen)
        if got.shape != want_pieces.shape:
            return f"output {i}: local shape {tuple(got.shape[mesh.ndim:])} != {tuple(want_pieces.shape[mesh.ndim:])}"
        if want.dtype.is_floating_point:
            tol = dict(rtol=1e-7, atol=1e-9) if want.dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
            ok = torch.allclose(got, want_pieces, **tol)
        else:
            ok = torch.equal(got, want_pieces)
        if not ok:
            err = (got.double() - want_pieces.double()).abs().max().item()
            return f"output {i} differs by {err:.3g}"
    return None


def _check_strategy(op, args, kwargs, expected: list[torch.Tensor], strategy: Strategy, spec,
                    mesh: MeshSpec, gen, mode) -> str | None:
    from torch.distributed._local_tensor import LocalTensor

    leaves, treespec = pytree.tree_flatten((args, kwargs))
    tensor_positions = [k for k, l in enumerate(leaves) if isinstance(l, torch.Tensor)]
    for k, layout in zip(tensor_positions, strategy.inputs):
        stacked = _split_local(leaves[k], layout, mesh.sizes, gen)
        flat = stacked.reshape(-1, *stacked.shape[mesh.ndim:])
        leaves[k] = LocalTensor({r: flat[r] for r in range(mesh.n_devices)})
    largs, lkwargs = pytree.tree_unflatten(leaves, treespec)
    largs, lkwargs = local_args(tuple(largs), lkwargs, spec.shape_arg,
                                strategy.outputs[0] if strategy.outputs else None, mesh)
    with mode:  # only the op itself runs per rank; cutting and checking stay plain torch
        out = op(*largs, **lkwargs)
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    if len(outs) != len(expected):
        return f"{len(outs)} outputs, expected {len(expected)}"
    return _assemble_check(outs, expected, strategy.outputs, mesh, gen)


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def _validate_rule(rule: Rule, mesh: MeshSpec, mode, report: ValidationReport) -> None:
    gen = torch.Generator().manual_seed(1234)
    for s_idx, (args, kwargs) in enumerate(rule.samples()):
        try:
            # On copies: an in-place op (index_put_, div_) must leave the sample whole for the pieces.
            expected_out = rule.op(*pytree.tree_map(_clone, args), **pytree.tree_map(_clone, kwargs))
        except Exception as exc:
            report.failures.append(Failure(rule.name, s_idx, mesh.sizes, "unsharded", f"sample fails: {exc}"))
            continue
        expected = [o for o in pytree.tree_leaves(expected_out) if isinstance(o, torch.Tensor)]
        spec = rule.fn(*args, **kwargs)
        ins = [tensor_info(t) for t in tensor_leaves(args, kwargs)]
        # Options a runtime algorithm runs (ring attention) are checked by that algorithm's own
        # multi-process test against the unsharded op: the op on each piece is not it.
        strategies = expand(without_algorithms(spec), ins, [tensor_info(t) for t in expected], mesh)
        for strategy in strategies:
            try:
                error = _check_strategy(rule.op, args, kwargs, expected, strategy, spec, mesh, gen, mode)
            except Exception as exc:  # a rule whose local op fails is a wrong rule; report it
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if error is None:
                report.passed += 1
                report.cases_per_rule[rule.name] = report.cases_per_rule.get(rule.name, 0) + 1
            else:
                report.failures.append(Failure(rule.name, s_idx, mesh.sizes, str(strategy), error))


def validate_rules(mesh_shapes: Iterable[Sequence[int]] = ((2,), (2, 2), (2, 2, 2)),
                   ops: Iterable[Any] | None = None) -> ValidationReport:
    """Check every strategy of every rule (or of ``ops``) on each mesh shape; see module doc."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    report = ValidationReport()
    rules = [get_rule(op) for op in (ops if ops is not None else registered_ops())]
    for rule in rules:
        if not rule.samples():
            report.rules_without_samples.append(rule.name)
    if dist.is_initialized():
        raise RuntimeError("validate_rules needs its own fake process group; call it outside torch.distributed")
    for shape in mesh_shapes:
        shape = tuple(shape)
        mesh = MeshSpec(tuple(f"a{k}" for k in range(len(shape))), shape)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=mesh.n_devices)
        try:
            mode = LocalTensorMode(mesh.n_devices)
            for rule in rules:
                _validate_rule(rule, mesh, mode, report)
        finally:
            dist.destroy_process_group()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    report = validate_rules()
    for failure in report.failures:
        print("FAIL", failure)
    print(report.summary())
    return 1 if report.failures or report.rules_without_samples else 0


if __name__ == "__main__":
    sys.exit(main())
