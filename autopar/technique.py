"""The technique registry: a parallel technique is one frozen description, registered once.

A *technique* is a way of running ops in parallel that the plain rules + reshards do not
express on their own: ring attention, SUMMA's panel loop, Optimus's layer norm, or a whole
family of layouts (data parallel/ZeRO, Megatron, 2D/2.5D/3D, sequence parallel). Each lives
in one file under ``autopar/techniques/`` and calls :func:`register` with a :class:`Technique`.
The rest of autopar iterates over :func:`techniques` and never imports a technique by name:

* **annotate** (``passes.annotate``) asks every technique that covers a node's op for extra
  strategies (:attr:`Technique.strategies`) and tags the strategies a technique runs
  (:attr:`Technique.runs`): ``Strategy.technique`` holds the technique's name;
* **the cost problem** (``cost_model.problem``) prices a tagged strategy's own collectives with
  :attr:`Technique.price` (a list of ``CommStep``; the evaluator counts their bytes exactly);
* **the lowering** (``passes.lower``) calls :attr:`Technique.lower`, which emits the call of
  the technique's runtime kernel (``runtime/``) in place of the op;
* **the search** (``autopar.planner``) offers every :class:`Family` as ``strategy="<name>"``
  (``--strategy <name>``): candidate meshes, each with a :class:`Pin` restricting the options;
* **the report** names a tagged strategy by :attr:`Technique.title`.

Adding a parallel dimension (expert parallelism, say) is one new file::

    # autopar/techniques/expert_parallel.py
    from autopar.technique import Family, Pin, Technique, register

    def _runs(node, strategy) -> bool:             # which strategies are this technique's
        return node.target is grouped_mm and <experts split on an axis>(strategy)

    def _price(ctx, node, strategy, backward):     # its own collectives, per step and rank
        return [CommStep("all_to_all", axis, ctx.tensor_bytes(node.args[0].meta["val"]) * ...)]

    def _lower(ctx, node, strategy, args, kwargs): # the runtime kernel replaces the op
        return ctx.graph.call_function(expert_dispatch_combine, (*args, ctx.groups[axis]))

    @dataclass(frozen=True)
    class ExpertPin(Pin):                          # what strategy="ep" means, per option
        axis: int = 0
        def __call__(self, node, option) -> bool: ...

    register(Technique(
        name="expert_parallel", title="expert parallel (experts split over an axis, tokens by all-to-all)",
        ops=frozenset({grouped_mm}), runs=_runs, price=_price, lower=_lower,
        families=(Family("ep", "experts over one axis", lambda n, hw: [(hw.mesh_spec(("ep",), (n,)), ExpertPin())]),),
    ))

New ops the technique needs (top-k, sort, histc, ...) get rules of their own
(``passes.rules.register_rule``), as any op does; :attr:`Technique.strategies` adds variants
the rules cannot state (SUMMA's panel-loop linear layer is one). ``cost_model.reshard.CommStep``
kinds priced today: all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, reduce, p2p.

This module is vocabulary: it imports nothing of autopar above ``strategy`` and ``mesh``, so
annotate, the cost model, the lowering and the planner can all read the registry. The
technique files (which import their pricing and runtime kernels) live in ``autopar/techniques/``
and are imported once by ``autopar.techniques.catalog``, which the search, the lowering and the
report import.
"""

from __future__ import annotations

import dataclasses

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import torch.fx as fx

from autopar.errors import AutoparError
from autopar.mesh import MeshSpec
from autopar.strategy import Strategy

if TYPE_CHECKING:  # (types only)
    from autopar.cost_model.reshard import CommStep

__all__ = ["Technique", "Family", "Pin", "PriceContext", "LowerContext", "Region", "RegionMatch", "register",
           "techniques", "technique", "families", "family", "techniques_for", "tag", "registered"]


class Pin:
    """A family's restriction on each node's candidate options, ``pin(node, (strategy, zero_axes))
    -> bool``. Subclasses are frozen dataclasses (their fields are the family's parameters);
    two class-level settings the problem reads:

    * ``zero2``: the family uses ZeRO-2 options (gradients and optimizer state split over the
      axes where a parameter is replicated), so the problem must offer them;
    * ``strict``: an input left with no option is an error (``PinError``); non-strict pins
      leave such an input free instead."""

    zero2: bool = False
    strict: bool = True

    def __call__(self, node: fx.Node, option: tuple[Strategy, tuple[int, ...]]) -> bool:
        raise NotImplementedError

    def on_mesh(self, sizes: tuple[int, ...]) -> "Pin":
        """This pin for a mesh of ``sizes``: axes of size 1 dropped from its ``*_axes`` fields.
        Such an axis offers only replicated placements (``passes/annotate.py``: a shard there is
        the whole tensor), so a family asks nothing of it (``strategy="dp"`` on 1 device)."""
        if not dataclasses.is_dataclass(self) or all(size > 1 for size in sizes):
            return self
        changes = {f.name: tuple(a for a in getattr(self, f.name) if sizes[a] > 1) for f in dataclasses.fields(self)
                   if f.name.endswith("_axes") and isinstance(getattr(self, f.name), tuple)}
        return dataclasses.replace(self, **changes) if changes else self


@dataclass(frozen=True)
class Family:
    """A pinnable family: ``strategy=name`` plans on ``meshes(n_devices, hardware)``, a list of
    (mesh, pin) candidates of which the planner keeps the fastest."""

    name: str
    description: str
    meshes: Callable[[int, Any], list[tuple[MeshSpec, Pin]]]
    rank: int = 100  # where ``STRATEGY_FAMILIES`` lists it (lower first; ties by name)
    baseline: bool = False  # priced beside every auto plan, in the report's baselines table


@dataclass(frozen=True)
class PriceContext:
    """What a technique's pricing reads: the mesh, the training set-up (``TrainingSpec``), which
    nodes need a gradient (node name -> bool) and the bytes of a traced tensor."""

    mesh: MeshSpec
    train: Any
    needs: Mapping[str, bool]
    tensor_bytes: Callable[[Any], float]


@dataclass(frozen=True)
class LowerContext:
    """What a technique's lowering writes with: the per-rank graph under construction, the
    process-group key of each mesh axis (``groups[axis]``), the mesh, and ``env``: the per-rank
    value of every traced node lowered so far, by name. A technique that replaces a sub-graph
    tags each of its ops (``runs``), emits its kernel at the first and, at the others, returns
    the kernel's outputs read from ``env`` (e.g. ``operator.getitem`` of the kernel's node)."""

    graph: fx.Graph
    groups: Sequence[Any]
    mesh: MeshSpec
    env: Mapping[str, fx.Node]


@dataclass(frozen=True)
class RegionMatch:
    """A sub-graph a region technique runs as one call (``Technique.regions`` finds them):
    ``nodes``, in graph order, the last one the region's only value used outside it; ``inputs``,
    the values from outside the region, in the order the region's call takes them."""

    nodes: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]


@dataclass(frozen=True)
class Region:
    """The target of a collapsed region's node (``passes.regions``): calling it runs the
    original sub-graph, so a strategy the technique does not run (its ``runs`` says no) is the
    sub-graph on local tensors. Two regions of the same technique and the same op sequence are
    equal, so repeated blocks (one MoE layer per transformer block) still share decisions."""

    technique: str  # the registered technique that found it
    kind: str  # a short name: the node's name and the program's call read ``region_<kind>``
    signature: tuple[str, ...]  # the targets of the sub-graph's ops, in order
    graph_module: fx.GraphModule = field(compare=False, hash=False, repr=False)

    @property
    def __name__(self) -> str:  # the name torch.fx code generation gives the call
        return f"region_{self.kind}"

    def __call__(self, *args: Any) -> Any:
        return self.graph_module(*args)


@dataclass(frozen=True)
class Technique:
    """One registered parallel technique (module doc). Every hook is optional:

    * ``ops``: the op targets whose strategies it may run (``runs`` and ``strategies`` are asked
      about these only); empty for a technique that only offers families;
    * ``runs(node, strategy) -> bool``: whether ``strategy`` of ``node`` is this technique's;
      annotate records it on the strategy (``Strategy.technique``);
    * ``strategies(node, strategies, mesh) -> list[Strategy]``: extra strategies for ``node``
      beyond its rule's (they must satisfy ``runs``);
    * ``price(ctx, node, strategy, backward) -> list[CommStep]``: the technique's collectives per
      training step on one rank (``backward=False``: the forward's only, what a recompute
      repeats); bytes must equal what its runtime kernel sends;
    * ``lower(ctx, node, strategy, args, kwargs) -> fx.Node``: the call replacing the op in the
      per-rank program, with ``args``/``kwargs`` already local tensors;
    * ``regions(gm) -> list[RegionMatch]``: sub-graphs it runs as one call (a mixture-of-experts
      block: routing, dispatch, experts, combine); ``passes.regions`` collapses each into one
      node whose target is a :class:`Region` naming this technique; that node's strategies all
      come from ``strategies`` (no rule covers it), its collectives from ``price`` and its
      compute is the sum of the sub-graph's ops;
    * ``families``: the :class:`Family` pins it offers;
    * ``title``: how the report names it; ``report(runs, axis_names) -> str``: the report's
      phrase for a plan where it runs the (node, strategy) pairs ``runs`` (None: not reported);
      ``sequence_parallel``: a plan running it is sequence parallel (the report says ``+SP``).
    """

    name: str
    title: str
    ops: frozenset = frozenset()
    runs: Callable[[fx.Node, Strategy], bool] | None = None
    strategies: Callable[[fx.Node, Sequence[Strategy], MeshSpec], list[Strategy]] | None = None
    price: Callable[[PriceContext, fx.Node, Strategy, bool], "list[CommStep]"] | None = None
    lower: Callable[[LowerContext, fx.Node, Strategy, tuple, dict], fx.Node] | None = None
    regions: Callable[[fx.GraphModule], list[RegionMatch]] | None = None
    families: tuple[Family, ...] = ()
    report: Callable[[list[tuple[fx.Node, Strategy]], Sequence[str]], str] | None = None
    sequence_parallel: bool = False


# The registry: filled at import time by the technique files, read-only afterwards (as
# passes.rules' op rules are). Ordered: annotate adds strategies in registration order.
_TECHNIQUES: dict[str, Technique] = {}
_FAMILIES: dict[str, tuple[Family, str]] = {}
_BY_OP: dict[Any, tuple[Technique, ...]] = {}


def register(t: Technique) -> Technique:
    """Add ``t`` to the registry; a name or family already taken is an error."""
    if t.name in _TECHNIQUES and _TECHNIQUES[t.name] is not t:
        raise AutoparError(f"technique {t.name!r} is registered twice; give the new one another name")
    for f in t.families:
        if f.name in _FAMILIES and _FAMILIES[f.name][1] != t.name:
            raise AutoparError(f"family {f.name!r} of technique {t.name!r} is already offered by technique "
                               f"{_FAMILIES[f.name][1]!r}; pick another family name")
    _TECHNIQUES[t.name] = t
    for f in t.families:
        _FAMILIES[f.name] = (f, t.name)
    for op in t.ops:
        _BY_OP[op] = tuple(x for x in _BY_OP.get(op, ()) if x.name != t.name) + (t,)
    return t


@contextlib.contextmanager
def registered(t: Technique) -> Iterator[Technique]:
    """``t`` registered for the ``with`` block only (tests, experiments): the registry is as it
    was afterwards. Annotate again after the block: strategies annotated inside carry its name."""
    saved = dict(_TECHNIQUES), dict(_FAMILIES), dict(_BY_OP)
    register(t)
    try:
        yield t
    finally:
        for live, old in zip((_TECHNIQUES, _FAMILIES, _BY_OP), saved):
            live.clear()
            live.update(old)


def techniques() -> Iterator[Technique]:
    """Every registered technique, in registration order."""
    return iter(tuple(_TECHNIQUES.values()))


def technique(name: str) -> Technique:
    """The technique registered as ``name``."""
    return _TECHNIQUES[name]


def techniques_for(op: Any) -> tuple[Technique, ...]:
    """The techniques that cover ``op`` (a node's target; a :class:`Region`: the one that found it)."""
    if isinstance(op, Region):
        return (_TECHNIQUES[op.technique],) if op.technique in _TECHNIQUES else ()
    return _BY_OP.get(op, ())


def families() -> tuple[Family, ...]:
    """Every registered family, by rank (then name)."""
    return tuple(sorted((f for f, _ in _FAMILIES.values()), key=lambda f: (f.rank, f.name)))


def family(name: str) -> Family | None:
    """The family pinned by ``strategy=name``, or None."""
    entry = _FAMILIES.get(name)
    return entry[0] if entry else None


def tag(node: fx.Node, strategies: Sequence[Strategy]) -> tuple[Strategy, ...]:
    """``strategies`` of ``node`` with each one a technique runs carrying its name."""
    if isinstance(node.target, Region):
        covering = [t for t in (_TECHNIQUES.get(node.target.technique),) if t is not None and t.runs is not None]
    else:
        covering = [t for t in techniques_for(node.target) if t.runs is not None]
    if not covering:
        return tuple(strategies)
    out = []
    for s in strategies:
        name = next((t.name for t in covering if t.runs(node, s)), None)
        out.append(s if name == s.technique else s.with_technique(name))
    return tuple(out)
