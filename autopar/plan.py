"""Plan: the chosen mesh, a strategy per node, predicted time / memory / traffic, the solver's
statistics and the baselines, with JSON round trip, ``explain`` and ``diff``."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from .cost_model.evaluate import evaluate
from .errors import AutoparError, format_bytes
from .mesh import Link, MeshSpec
from .pipeline_info import PipelineInfo

__all__ = ["Plan", "NodePlan", "SolverStats", "BaselineResult", "PlanFormatError", "PLAN_FORMAT_VERSION"]

PLAN_FORMAT_VERSION = 1


class PlanFormatError(AutoparError):
    """A plan file that is not valid JSON or misses required fields."""


@dataclass(frozen=True)
class NodePlan:
    name: str
    op: str
    strategy: str
    output_layout: str
    input_layouts: tuple[str, ...] = ()
    zero_axes: tuple[int, ...] = ()  # parameters: gradients and optimizer state split over these axes
    shares_with: str = ""  # the node of the first repeated block whose decision this node shares
    follows: str = ""  # a follower's root: the node whose decision sets this node's layout


@dataclass(frozen=True)
class SolverStats:
    name: str
    status: str
    seconds: float
    objective: float
    lower_bound: float
    n_variables: int
    n_constraints: int
    ilps_solved: int = 1
    plan_seconds: float = 0.0
    mesh_search: str = ""

    @property
    def gap(self) -> float:
        if self.objective <= 0:
            return 0.0
        if self.lower_bound != self.lower_bound:
            return float("nan")
        return max(0.0, (self.objective - self.lower_bound) / self.objective)


@dataclass(frozen=True)
class BaselineResult:
    name: str
    mesh: str
    step_seconds: float
    peak_memory_bytes_per_device: float
    feasible: bool


@dataclass(frozen=True)
class Plan:
    model: str
    n_devices: int
    mesh: MeshSpec
    hardware: str
    strategy: str
    optimizer: str
    mixed_precision: bool
    memory_budget_bytes: float
    step_seconds: float
    compute_seconds: float
    comm_seconds: float
    param_state_bytes: float
    activation_bytes: float
    comm_bytes: dict[str, float]
    solver: SolverStats
    baselines: tuple[BaselineResult, ...]
    nodes: tuple[NodePlan, ...]
    # Digest of the traced graph's ops and shapes (``autopar.trace.graph_fingerprint``):
    # parallelize refuses a plan made for another model or other input shapes.
    graph_fingerprint: str = ""
    # Pipeline stages, schedule and bubble (autopar.pipeline_search), or None: no pipeline.
    pipeline: PipelineInfo | None = None
    # Runs of repeated blocks (container paths, e.g. "blocks") whose activations are recomputed
    # in backward (cost_model/recompute.py; the runtime checkpoints them: passes/recompute_regions.py)
    recompute: tuple[str, ...] = ()
    # ZeRO-Offload (cost_model/offload.py): optimizer state per device kept in host memory
    host_bytes: float = 0.0
    # Per-group offload: the parameters (targets) whose state is on the host, the rest stepped on
    # the device; empty with host bytes: every parameter (autopar/offload_search.py)
    offload_params: tuple[str, ...] = ()
    # A pipelined plan: each model chunk's own plan (one micro-batch on the stage mesh, its
    # graph a piece cut by passes/split_stages), in model order; runtime/pipeline.py runs them.
    stage_plans: tuple["Plan", ...] = ()
    # The priced problem (cost_model.problem.Problem) and the chosen strategy index per
    # decision, kept in memory for explain() and the report; not serialized (None once read back).
    problem: Any = field(default=None, repr=False, compare=False)
    choice: Any = field(default=None, repr=False, compare=False)

    # The step's peak device bytes, walked block by block (cost_model/liveness.py: gradients and
    # activations are never all alive at once); None (pipelines, old plan files): the sum above.
    step_peak_bytes: float | None = None
    bucket_bytes: float = 0.0  # gradient all-reduce buckets (counted in param_state_bytes)

    @property
    def peak_memory_bytes_per_device(self) -> float:
        if self.step_peak_bytes is not None:
            return self.step_peak_bytes
        return self.param_state_bytes + self.activation_bytes

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"plan has no node {name!r}; node names are those of autopar.trace's graph")

    # --- JSON ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": PLAN_FORMAT_VERSION,
            "model": self.model,
            "graph_fingerprint": self.graph_fingerprint,
            "n_devices": self.n_devices,
            "mesh": {"axes": dict(zip(self.mesh.axes, self.mesh.sizes)),
                     "links": [l.to_json() for l in self.mesh.links]},
            "hardware": self.hardware,
            "strategy": self.strategy,
            "optimizer": self.optimizer,
            "mixed_precision": self.mixed_precision,
            "memory_budget_bytes": self.memory_budget_bytes,
            "predicted": {
                "step_seconds": self.step_seconds,
                "compute_seconds": self.compute_seconds,
                "comm_seconds": self.comm_seconds,
                "peak_memory_bytes_per_device": self.peak_memory_bytes_per_device,
                "param_state_bytes_per_device": self.param_state_bytes,
                "activation_bytes_per_device": self.activation_bytes,
                "step_peak_bytes_per_device": self.step_peak_bytes,
                "bucket_bytes_per_device": self.bucket_bytes,
                "comm_bytes_per_device": dict(self.comm_bytes),
            },
            "solver": {"name": self.solver.name, "status": self.solver.status, "seconds": self.solver.seconds,
                       "objective": self.solver.objective, "lower_bound": _num(self.solver.lower_bound),
                       "n_variables": self.solver.n_variables, "n_constraints": self.solver.n_constraints,
                       "ilps_solved": self.solver.ilps_solved, "plan_seconds": self.solver.plan_seconds,
                       "mesh_search": self.solver.mesh_search},
            "baselines": [{"name": b.name, "mesh": b.mesh, "step_seconds": _num(b.step_seconds),
                           "peak_memory_bytes_per_device": _num(b.peak_memory_bytes_per_device),
                           "feasible": b.feasible} for b in self.baselines],
            "nodes": [{"name": n.name, "op": n.op, "strategy": n.strategy, "output_layout": n.output_layout,
                       "input_layouts": list(n.input_layouts), "zero_axes": list(n.zero_axes),
                       "shares_with": n.shares_with, "follows": n.follows} for n in self.nodes],
            "pipeline": self.pipeline.to_dict() if self.pipeline is not None else None,
            "recompute": list(self.recompute),
            "host_bytes_per_device": self.host_bytes,
            "offload_params": list(self.offload_params),
            "stage_plans": [p.to_dict() for p in self.stage_plans],
        }

    def to_json(self, path: str | None = None, indent: int = 1) -> str:
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str) -> "Plan":
        """Read a plan from a JSON string or a path to a JSON file (``str`` or ``os.PathLike``)."""
        if isinstance(text_or_path, os.PathLike):
            text_or_path = os.fspath(text_or_path)
        if not isinstance(text_or_path, str) or not text_or_path.strip():
            raise PlanFormatError(f"Plan.from_json needs a JSON string or a file path, got {text_or_path!r}; "
                                  "pass what Plan.to_json wrote (or autopar plan --json PATH)")
        text = text_or_path
        if not text_or_path.lstrip().startswith(("{", "[")):
            try:
                with open(text_or_path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                why = exc.strerror if isinstance(exc, OSError) else "not a UTF-8 text file"
                raise PlanFormatError(f"cannot read plan file {text_or_path!r}: {why}; pass the path that "
                                      "Plan.to_json or autopar plan --json wrote") from exc
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            cut = " (the text ends before the plan does: truncated?)" if not text.rstrip().endswith("}") else ""
            raise PlanFormatError(f"plan is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}{cut}; "
                                  "write plans with Plan.to_json or autopar plan --json, and re-plan if the file "
                                  "was truncated or edited") from exc
        if not isinstance(d, dict):
            raise PlanFormatError(f"a plan is a JSON object, got a JSON {type(d).__name__}; write plans with "
                                  "Plan.to_json")
        try:
            return cls._from_dict(d)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlanFormatError(f"malformed plan: missing or bad field {exc}; write plans with Plan.to_json "
                                  "(and re-plan: a plan file is not meant to be edited)") from exc

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> "Plan":
        if d.get("format_version") != PLAN_FORMAT_VERSION:
            raise ValueError(f"format_version {d.get('format_version')!r} (this autopar reads {PLAN_FORMAT_VERSION})")
        axes = d["mesh"]["axes"]
        links = tuple(Link.from_json(l) for l in d["mesh"].get("links", []))
        mesh = MeshSpec(tuple(axes), tuple(int(v) for v in axes.values()), links)
        pred, s = d["predicted"], d["solver"]
        return cls(
            model=d["model"], n_devices=int(d["n_devices"]), mesh=mesh, hardware=d["hardware"],
            strategy=d["strategy"], optimizer=d["optimizer"], mixed_precision=bool(d["mixed_precision"]),
            memory_budget_bytes=float(d["memory_budget_bytes"]), step_seconds=float(pred["step_seconds"]),
            compute_seconds=float(pred["compute_seconds"]), comm_seconds=float(pred["comm_seconds"]),
            param_state_bytes=float(pred["param_state_bytes_per_device"]),
            activation_bytes=float(pred["activation_bytes_per_device"]),
            comm_bytes={k: float(v) for k, v in pred["comm_bytes_per_device"].items()},
            solver=SolverStats(s["name"], s["status"], float(s["seconds"]), float(s["objective"]),
                               float(s["lower_bound"]) if s["lower_bound"] is not None else float("nan"),
                               int(s["n_variables"]), int(s["n_constraints"]), int(s.get("ilps_solved", 1)),
                               float(s.get("plan_seconds", 0.0)), s.get("mesh_search", "")),
            baselines=tuple(BaselineResult(b["name"], b["mesh"], _inf(b["step_seconds"]),
                                           _inf(b["peak_memory_bytes_per_device"]), bool(b["feasible"]))
                            for b in d["baselines"]),
            nodes=tuple(NodePlan(n["name"], n["op"], n["strategy"], n["output_layout"],
                                 tuple(n.get("input_layouts", ())), tuple(n.get("zero_axes", ())),
                                 n.get("shares_with", ""), n.get("follows", "")) for n in d["nodes"]),
            graph_fingerprint=str(d.get("graph_fingerprint", "")),
            recompute=tuple(str(x) for x in d.get("recompute", ())),
            host_bytes=float(d.get("host_bytes_per_device", 0.0)),
            offload_params=tuple(str(x) for x in d.get("offload_params", ())),
            step_peak_bytes=(float(pred["step_peak_bytes_per_device"])
                             if pred.get("step_peak_bytes_per_device") is not None else None),
            bucket_bytes=float(pred.get("bucket_bytes_per_device", 0.0)),
            pipeline=PipelineInfo.from_dict(d["pipeline"]) if d.get("pipeline") else None,
            stage_plans=tuple(cls._from_dict(p) for p in d.get("stage_plans", ())),
        )

    # --- explain and diff ----------------------------------------------------------------

    def explain(self, node_name: str, top: int = 3) -> str:
        """Why ``node_name`` got its layout: its cost, and the best alternatives' step times."""
        n = self.node(node_name)
        lines = [f"{n.name} ({n.op}): {n.strategy}"]
        if n.zero_axes:
            lines.append(f"  gradients and optimizer state split over axes "
                         f"{', '.join(self.mesh.axes[a] for a in n.zero_axes)} (ZeRO-2)")
        if n.shares_with and n.shares_with != n.name:
            lines.append(f"  shares its decision with {n.shares_with} (a repeated block)")
        problem, choice = self.problem, self.choice
        if problem is None:
            lines.append("  (alternatives need the in-memory plan from autopar.plan, not a JSON file)")
            return "\n".join(lines)
        key = problem.rep_of[node_name]
        if key in problem.followers:
            root = problem.followers[key][0]
            lines.append(f"  follows {root}: it takes its producer's layout (no decision of its own)")
            key = root
        d = problem.decisions[key]
        base = evaluate(problem, choice)
        alternatives = []
        for i, (st, zero) in enumerate(d.options):
            if i == choice[key]:
                continue
            alt = evaluate(problem, {**choice, key: i})
            alternatives.append((alt.step_seconds, alt.peak_memory_bytes, st, zero))
        alternatives.sort(key=lambda t: t[0])
        lines.append(f"  chosen: step {base.step_seconds * 1e3:.3f} ms, peak {format_bytes(base.peak_memory_bytes)}"
                     f" ({len(d.options)} options for {key})")
        for step, mem, st, zero in alternatives[:top]:
            fits = "" if mem <= self.memory_budget_bytes else ", over budget"
            z = f" zero on {zero}" if zero else ""
            lines.append(f"  alternative {st}{z}: step {step * 1e3:.3f} ms "
                         f"({(step / base.step_seconds - 1) * 100:+.1f}%), peak {format_bytes(mem)}{fits}")
        return "\n".join(lines)

    def diff(self, other: "Plan") -> str:
        """What differs between two plans: mesh, predictions, and nodes whose strategy changed."""
        lines = []
        if str(self.mesh) != str(other.mesh):
            lines.append(f"mesh: {self.mesh} -> {other.mesh}")
        for label, a, b, unit in (("step", self.step_seconds, other.step_seconds, 1e3),
                                  ("peak memory", self.peak_memory_bytes_per_device,
                                   other.peak_memory_bytes_per_device, 2**-30)):
            if a != b:
                u = "ms" if unit == 1e3 else "GiB"
                lines.append(f"{label}: {a * unit:.3f} -> {b * unit:.3f} {u} ({(b / a - 1) * 100 if a else 0:+.1f}%)")
        theirs = {n.name: n for n in other.nodes}
        changed = [(n, theirs[n.name]) for n in self.nodes if n.name in theirs and
                   (n.strategy, n.zero_axes) != (theirs[n.name].strategy, theirs[n.name].zero_axes)]
        for a, b in changed:
            lines.append(f"{a.name}: {a.strategy} -> {b.strategy}")
        only = sorted(set(theirs) ^ {n.name for n in self.nodes})
        if only:
            lines.append(f"{len(only)} nodes in only one plan (different models?)")
        return "\n".join(lines) if lines else "plans are identical"


def _num(x: float) -> float | None:
    return None if (x != x or math.isinf(x)) else x


def _inf(x: Any) -> float:
    return math.inf if x is None else float(x)
