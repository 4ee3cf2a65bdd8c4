"""Compute and memory cost of one node's strategy on one device.

Compute time follows the roofline with a per-kernel floor (the form meta's autoparallel uses):
``max(flops / (efficiency * peak), bytes / (efficiency * bandwidth)) + kernel_overhead``, on
the *local* work: a strategy divides the work by the size of every mesh axis on which some
tensor of the node is sharded (on an axis where everything is replicated or only partial
values pass through, every device does the whole op). Backward is twice the forward FLOPs
for contractions (gradients of both operands) and about one forward for the rest.
Softmax-like ops (softmax, log-softmax, the cross-entropy loss) move their bytes at the
calibrated ``Hardware.softmax_bytes_per_s`` where a profile has it: on CPU their exp/log and row
reductions run several times below the streaming rate (the loss of a GPT with an 8192-word
vocabulary measured ~10x its streaming-rate price here).

Memory of a strategy is the activation it keeps for backward (its output, unless the op is a
view); parameters, gradients and optimizer state are priced on parameter nodes
(:func:`param_state_bytes`), where ZeRO choices act.

A collapsed region (``passes.regions``) costs the sum of its ops' FLOPs, with backward
``Hardware.backward_ratio`` times forward when it holds a contraction (2 by FLOPs).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

from autopar.errors import BadArgumentError
from autopar.mesh import MeshSpec
from autopar.strategy import Layout, Strategy
from autopar.technique import Region

from .hardware import Hardware
from .saved_inputs import kept_output, saved_facts

__all__ = ["TrainingSpec", "node_flops", "compute_seconds", "kernel_overhead_seconds", "activation_bytes",
           "param_state_bytes", "is_view", "OPTIMIZER_STATE_BYTES", "RECOMPUTE_MODES", "OpFacts", "op_facts"]

aten = torch.ops.aten

# Bytes of optimizer state per parameter element (fp32 moments): Adam/AdamW keep two, SGD
# with momentum one. Mixed precision adds an fp32 master copy (ZeRO paper, arXiv 1910.02054).
RECOMPUTE_MODES = ("none", "full", "auto", "selective")

OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 4, "lamb": 8, "lars": 4}


@dataclass(frozen=True)
class TrainingSpec:
    """What a training step does to memory and time: optimizer and precision."""

    optimizer: str = "adamw"
    mixed_precision: bool = True  # bf16 compute/activations/params, fp32 master weights
    # Activation recompute of repeated blocks (cost_model/recompute.py): "none", "full" (pinned)
    # or "auto" (the ILP chooses per block run)
    recompute: str = "auto"
    # ZeRO-Offload: optimizer state and fp32 master weights in host memory, the step on the host
    # CPU (cost_model/offload.py): True for every parameter, or a tuple of the parameter names
    # (targets) offloaded, the rest stepped on the device
    offload: bool | tuple[str, ...] = False

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise BadArgumentError(
                f"unknown optimizer {self.optimizer!r}; pick one of {', '.join(OPTIMIZER_STATE_BYTES)}")
        if not isinstance(self.offload, bool) and not (
                isinstance(self.offload, tuple) and all(isinstance(t, str) for t in self.offload)):
            raise BadArgumentError(f"offload={self.offload!r} is neither a switch nor parameter names; pass "
                                   "offload=True or False, or a tuple of the parameter names to offload")
        if self.recompute not in RECOMPUTE_MODES:
            raise BadArgumentError(f"recompute={self.recompute!r} is not a recompute mode; pick one of "
                               f"{', '.join(RECOMPUTE_MODES)} ('full' recomputes every repeated block's "
                               f"activations, 'auto' lets the planner choose, 'selective' recomputes each "
                               f"block's attention only)")

    @property
    def activation_bytes_per_elem(self) -> int:
        return 2 if self.mixed_precision else 4

    @property
    def param_bytes_per_elem(self) -> int:
        return 2 if self.mixed_precision else 4

    @property
    def state_bytes_per_elem(self) -> int:
        """Optimizer state (and the fp32 master copy under mixed precision) per parameter element."""
        return OPTIMIZER_STATE_BYTES[self.optimizer] + (4 if self.mixed_precision else 0)


_VIEWS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
    aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.expand.default,
    aten.slice.Tensor, aten.select.int, aten.alias.default, aten.detach.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int, aten.flatten.using_ints,
    operator.getitem,
}
_CONTRACTIONS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default,
                 aten.matmul.default, aten.linear.default, aten.conv2d.default}


# Ops priced at ``Hardware.softmax_bytes_per_s`` (exp/log over rows and row reductions), where a
# calibrated profile has it. The cross-entropy loss is log-softmax plus a gather of one element
# per row: besides its input it writes the log-probabilities (one more input-sized tensor), as
# much as a log-softmax moves (measured: 4.1 vs 3.6 ms for 256 x 8192 fp32, one thread).
_SOFTMAX_LIKE = {aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int,
                 aten.cross_entropy_loss.default}


def is_view(node: fx.Node) -> bool:
    return node.op != "call_function" or node.target in _VIEWS


def _numel(t: Any) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else 0


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, fx.Node):
        return _tensors(x.meta.get("val"))
    return []


def node_flops(node: fx.Node) -> float:
    """Forward FLOPs of the whole (unsharded) op; of a collapsed region, its ops' sum."""
    if isinstance(node.target, Region):
        return sum(node_flops(n) for n in node.target.graph_module.graph.nodes)
    if node.op != "call_function" or node.target in _VIEWS:
        return 0.0
    out = _tensors(node)
    out_numel = sum(t.numel() for t in out)
    ins = [t for a in node.args for t in _tensors(a)]
    if node.target in _CONTRACTIONS:
        if node.target == aten.conv2d.default:
            w = ins[1]  # [out, in / groups, kh, kw]
            return 2.0 * out_numel * w.shape[1] * w.shape[2] * w.shape[3]
        a = ins[1] if node.target in (aten.addmm.default, aten.baddbmm.default) else ins[0]
        return 2.0 * out_numel * a.shape[-1]
    if node.target == aten.scaled_dot_product_attention.default:
        q, k = ins[0], ins[1]
        causal = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
        flops = 4.0 * q.numel() * k.shape[-2]
        return flops / 2 if causal else flops
    return float(out_numel) * 4  # elementwise-ish: a few operations per element


def _bytes_moved(node: fx.Node, elem_bytes: int) -> float:
    ins = [t for a in list(node.args) + list(node.kwargs.values()) for t in _tensors(a)]
    return float(sum(t.numel() for t in ins) + sum(t.numel() for t in _tensors(node))) * elem_bytes


def work_split(strategy: Strategy, mesh: MeshSpec) -> int:
    """How many ways the node's work is divided: the sizes of the axes where a tensor is sharded
    (a Shard's code is its dim, >= 0: ``Layout.codes``, ints instead of torch's placements)."""
    split = 1
    layouts = strategy.inputs + strategy.outputs
    for a, size in enumerate(mesh.sizes):
        if any(l.codes[a] >= 0 for l in layouts):
            split *= size
    return split


@dataclass(frozen=True)
class OpFacts:
    """What ``compute_seconds`` and ``activation_bytes`` need of a node that no strategy or
    mesh changes: computed once per node (``op_facts``), not once per strategy priced."""

    flops: float  # node_flops
    moved_elems: int  # elements of every tensor input and output (``_bytes_moved`` / elem bytes)
    loss_input_elems: int  # the cross-entropy loss's input (its log-probabilities written), else 0
    contraction: bool  # _has_contraction
    outs: tuple[tuple[int, bool, int], ...]  # (numel, floating point, element size) per output
    kept: bool  # kept_output (True when not asked: no gradient, or a view)
    extra_bytes: float  # saved_facts(...).extra_bytes (0 when not asked)


def op_facts(node: fx.Node, needs: dict[str, bool], needs_grad: bool) -> OpFacts:
    """The strategy-independent facts of ``node`` (``needs``: which nodes need a gradient)."""
    priced = node.op == "call_function" and node.target not in _VIEWS
    ce = priced and node.target == aten.cross_entropy_loss.default
    ins = [t for a in list(node.args) + list(node.kwargs.values()) for t in _tensors(a)] if priced else []
    outs = _tensors(node)
    saving = needs_grad and not is_view(node)
    return OpFacts(
        flops=node_flops(node) if priced else 0.0,
        moved_elems=sum(t.numel() for t in ins) + sum(t.numel() for t in outs) if priced else 0,
        loss_input_elems=_numel(_tensors(node.args[0])[0]) if ce else 0,
        contraction=_has_contraction(node),
        outs=tuple((t.numel(), t.dtype.is_floating_point, t.element_size()) for t in outs),
        kept=kept_output(node, needs, _VIEWS) if saving else True,
        extra_bytes=saved_facts(node, needs).extra_bytes if saving else 0.0)


def compute_seconds(node: fx.Node, strategy: Strategy, mesh: MeshSpec, hw: Hardware, train: TrainingSpec,
                    needs_grad: bool, facts: OpFacts | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of ``node`` run with ``strategy`` on one device; ``facts``:
    ``op_facts(node, ...)``, given by a caller that prices many strategies of one node."""
    if node.op != "call_function" or node.target in _VIEWS:
        return 0.0, 0.0
    split = work_split(strategy, mesh)
    if facts is None:
        flops = node_flops(node) / split
        moved = _bytes_moved(node, train.activation_bytes_per_elem) / split
    else:
        flops = facts.flops / split
        moved = float(facts.moved_elems) * train.activation_bytes_per_elem / split
    peak = hw.peak_flops if train.mixed_precision else hw.peak_flops_fp32
    bandwidth = hw.efficiency * hw.memory_bandwidth_bytes_per_s
    if node.target in _SOFTMAX_LIKE and hw.softmax_bytes_per_s > 0:
        bandwidth = hw.softmax_bytes_per_s  # a measured rate (autopar calibrate): no efficiency on top
        if node.target == aten.cross_entropy_loss.default:
            elems = _numel(_tensors(node.args[0])[0]) if facts is None else facts.loss_input_elems
            moved += elems * train.activation_bytes_per_elem / split
    fwd = max(flops / (hw.efficiency * peak), moved / bandwidth)
    fwd += hw.kernel_overhead_s
    if not needs_grad:
        return fwd, 0.0
    contraction = _has_contraction(node) if facts is None else facts.contraction
    bwd = hw.backward_ratio * fwd if contraction else fwd
    return fwd, bwd


def kernel_overhead_seconds(node: fx.Node, hw: Hardware, needs_grad: bool) -> float:
    """The part of ``compute_seconds(node, ...)``'s forward + backward that does not shrink with
    the work: its per-kernel floor, the same for every strategy. A pipeline's micro-batch pays it
    in full however small the micro-batch (``autopar.pipeline_parts.Part.fixed_seconds``)."""
    if node.op != "call_function" or node.target in _VIEWS:
        return 0.0
    if not needs_grad:
        return hw.kernel_overhead_s
    return hw.kernel_overhead_s * (1.0 + (hw.backward_ratio if _has_contraction(node) else 1.0))


def _has_contraction(node: fx.Node) -> bool:
    """The op (or a collapsed region's op) is a matmul or attention: backward costs
    ``Hardware.backward_ratio`` times forward (twice by FLOPs)."""
    if isinstance(node.target, Region):
        return any(_has_contraction(n) for n in node.target.graph_module.graph.nodes)
    return node.target in _CONTRACTIONS or node.target == aten.scaled_dot_product_attention.default


def activation_bytes(node: fx.Node, strategy: Strategy, mesh: MeshSpec, train: TrainingSpec,
                     needs_grad: bool, needs: dict[str, bool] | None = None, facts: OpFacts | None = None) -> float:
    """Bytes this node keeps alive until its backward, on one device. With ``needs`` (which
    nodes need a gradient), as autograd keeps them (``saved_inputs.kept_output``): its output
    only where it or a reader saves it, plus what the op saves besides (layer norm's
    statistics, attention's log-sum-exp); without, its output always (an upper bound).
    ``facts``: ``op_facts(node, needs, needs_grad)``, used only with ``needs``."""
    if not needs_grad or is_view(node):
        return 0.0
    if needs is None:
        outs, keep = tuple((t.numel(), t.dtype.is_floating_point, t.element_size()) for t in _tensors(node)), True
    else:
        facts = facts or op_facts(node, needs, needs_grad)
        outs, keep = facts.outs, facts.kept
    total = 0.0
    for (numel, floating, size), layout in zip(outs, strategy.outputs):
        elem = train.activation_bytes_per_elem if floating else size
        total += numel * elem * layout.local_fraction(mesh) * keep
    if needs is not None:  # per-row statistics and the like: split as the op's work is
        total += facts.extra_bytes / work_split(strategy, mesh)
    return total


def param_state_bytes(numel: int, layout: Layout, mesh: MeshSpec, train: TrainingSpec, zero_axes: Sequence[int] = ()
                      ) -> float:
    """Bytes one device holds for a parameter stored in ``layout``: weights, gradients and
    optimizer state; gradients and optimizer state are further split over ``zero_axes``
    (ZeRO-2 on axes where the parameter is replicated)."""
    local = numel * layout.local_fraction(mesh)
    zero_split = math.prod(mesh.sizes[a] for a in zero_axes)
    weights = local * train.param_bytes_per_elem
    grads = local * train.param_bytes_per_elem / zero_split
    state = local * train.state_bytes_per_elem / zero_split
    return weights + grads + state
