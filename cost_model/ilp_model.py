r"""The strategy ILP's model: its columns and rows from a priced ``Problem``, and the solvers that
solve it once (``cost_model.ilp.solve`` decides what to solve: see there).

Variables (see ``cost_model.problem`` for where the numbers come from):

* :math:`x_{d,i} \in \{0,1\}`: decision *d* takes option *i* (a strategy, and for parameters
  the ZeRO axes);
* :math:`e_{t,a,b} \in [0,1]`: on edge *t*, the producer's output has layout *a* and the
  consumer needs layout *b* (continuous; integral once *x* is);
* :math:`z_{g} \in [0,1]`: gradient all-reduce *g* is paid.

Objective (seconds per step)::

    min  sum_{d,i} T_{d,i} x_{d,i}  +  sum_{t,a,b} R_{t,a,b} e_{t,a,b}  +  sum_g C_g z_g  -  h

(h >= 0: the communication hidden behind compute, where the hardware overlaps any; 0 otherwise)

Constraints, each added by the function named:

* ``one_option``     (:func:`_add_decisions`): sum_i x_{d,i} = 1 for every decision d;
* ``edge_out``/``edge_in`` (:func:`_add_edges`): sum_b e_{t,a,b} = sum_{i: out(i)=a} x_{u,i} and
  sum_a e_{t,a,b} = sum_{i: in(i)=b} x_{v,i}: the edge's layout pair agrees with both ends;
* ``sync``           (:func:`_add_syncs`): z_g >= sum_{i in T_{g,d}} x_{d,i} - sum_{j in Z_g} x_{p,j}
  for every decision d, T_{g,d} its options that make the gradient partial, and Z_g the ZeRO-2
  options of the gradient's parameter p on g's axis (they reduce-scatter it instead, at their
  own price);
* ``recompute``      (:func:`_add_recompute`): r_k in {0,1} recomputes block run k; w_{d,i} =
  x_{d,i} r_k for its decisions (sum_i w_{d,i} = r_k, w_{d,i} <= x_{d,i}) and edges, costing the
  forward again (F_{d,i} w_{d,i}) and saving activation memory (-S_{d,i} w_{d,i} in ``memory``);
  ``recompute_one``: under ``recompute="auto"`` a run has two terms (the whole block, its attention
  segment) and sum_k r_k <= 1 over them;
* ``overlap_async``/``overlap_window`` (:func:`_add_overlap`, hardware with ``comm_overlap`` > 0):
  h <= overlap * (asynchronous collectives) and h <= overlap * (forward and backward compute);
* ``memory``         (:func:`_add_memory`): sum_{d,i} M_{d,i} x_{d,i} - sum S w <= budget bytes;
* ``host_memory``    (:func:`_add_host_memory`, offload only): sum_{d,i} H_{d,i} x_{d,i} <= host bytes.

The model is built once as a sparse matrix (:class:`Model`) and handed to HiGHS through
``highspy`` directly; PuLP with CBC is the fallback. (Building the same model through PuLP's
expression objects took 2 s of the 5 s budget for GPT-2 on 8 devices, so the default path does
not use them.) Every solve reports its status, seconds, objective and a lower bound (HiGHS's
MIP dual bound; with CBC the objective of the LP relaxation), so each plan carries its gap.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from .fsdp_pricing import fsdp_axis
from .problem import Problem, partial_grad_axes

__all__ = ["TIME_SCALE", "MEMORY_SCALE", "Model", "Built", "build_model", "solve_highs", "solve_cbc"]

# The model is built in microseconds and MiB: in seconds and bytes, costs of 1e-9 would sit
# under the solvers' tolerances (HiGHS's absolute MIP gap is 1e-6 and its dual feasibility
# tolerance 1e-7), and it stopped short of the optimum on small graphs.
TIME_SCALE = 1e6
MEMORY_SCALE = 1.0 / 2**20


@dataclass
class Model:
    """Columns (cost, bounds, integrality) and rows (bounds, coefficients) of the ILP."""

    cost: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    # what each row is, e.g. "one_option[linear]" or ("edge_out", producer, consumer, layout): edge
    # rows keep their parts unformatted (formatting their layouts cost more than the rest of a row)
    row_names: list = field(default_factory=list)
    # the coefficients: entry k is (entry_rows[k], entry_cols[k], entry_values[k]), rows in order
    entry_rows: list[int] = field(default_factory=list)
    entry_cols: list[int] = field(default_factory=list)
    entry_values: list[float] = field(default_factory=list)

    def col(self, cost_s: float, integer: bool = False) -> int:
        self.cost.append(cost_s * TIME_SCALE)
        self.upper.append(1.0)
        self.integer.append(integer)
        return len(self.cost) - 1

    def cols(self, costs_s) -> int:
        """Continuous columns of ``costs_s``, in order; returns the first one's index."""
        first = len(self.cost)
        self.cost.extend(c * TIME_SCALE for c in costs_s)
        n = len(self.cost) - first
        self.upper.extend([1.0] * n)
        self.integer.extend([False] * n)
        return first

    def row(self, name: "str | tuple", coeffs: list[tuple[int, float]], lower: float, upper: float) -> None:
        self.row_of(name, [c for c, _ in coeffs], [v for _, v in coeffs], lower, upper)

    def row_of(self, name: "str | tuple", cols: list[int], values: list[float], lower: float, upper: float) -> None:
        """A row whose coefficients are ``values`` on ``cols``."""
        r = len(self.row_lower)
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        self.row_names.append(name)
        self.entry_rows.extend([r] * len(cols))
        self.entry_cols.extend(cols)
        self.entry_values.extend(values)

    @property
    def entries(self) -> list[tuple[int, int, float]]:
        """(row, column, value) of every coefficient."""
        return list(zip(self.entry_rows, self.entry_cols, self.entry_values))

    def sorted_entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, columns, values) in the order ``sorted(self.entries)`` gives, by numpy."""
        rows = np.asarray(self.entry_rows, dtype=np.int64)
        cols = np.asarray(self.entry_cols, dtype=np.int64)
        vals = np.asarray(self.entry_values, dtype=np.float64)
        order = np.lexsort((vals, cols, rows))
        return rows[order], cols[order], vals[order]


def _add_decisions(m: Model, problem: Problem) -> dict[str, list[int]]:
    x = {}
    for key, d in problem.decisions.items():
        x[key] = [m.col(s, integer=True) for s in d.seconds]
        m.row(f"one_option[{key}]", [(c, 1.0) for c in x[key]], 1.0, 1.0)
    return x


def _classes(layouts: list) -> tuple[list, list[int], dict[int, int]]:
    """The equality classes of ``layouts`` in order of first appearance, each as its first
    layout (what dict keys by equality would keep); per layout, its class; id -> class. Each
    distinct object is hashed once (a Layout's hash is Python code; ids hash in C)."""
    ids = list(map(id, layouts))
    reps: list = []
    by_eq: dict = {}
    by_id: dict[int, int] = {}
    for i, layout in dict(zip(ids, layouts)).items():  # distinct objects, first appearance first
        g = by_eq.get(layout)
        if g is None:
            g = by_eq[layout] = len(reps)
            reps.append(layout)
        by_id[i] = g
    return reps, [by_id[i] for i in ids], by_id


def _add_edges(m: Model, problem: Problem, x, cols: dict | None = None) -> list[tuple[int, float]]:
    """The edge variables and rows; returns (column, bytes) of pairings that hold memory, and
    fills ``cols`` (edge index -> (its layout pairs, the first pair's column; the others follow))."""
    memory = []
    for idx, edge in enumerate(problem.edges):
        if not any(edge.seconds.values()) and not any(edge.memory.values()):
            continue  # every pairing is free: no variables needed
        pairs = list(edge.seconds)
        first = m.cols(edge.seconds.values())
        if cols is not None and pairs:
            cols[idx] = (pairs, first)
        if edge.memory:
            for k, ab in enumerate(pairs):
                if edge.memory.get(ab):
                    memory.append((first + k, edge.memory[ab]))
        # one row per distinct producer layout (edge_out), then per consumer layout (edge_in):
        # the pairs' columns with that layout, then the options that give or need it
        for kind, side, decision, layouts in (("edge_out", 0, edge.producer, edge.producer_layouts),
                                              ("edge_in", 1, edge.consumer, edge.consumer_layouts)):
            reps, of_pair, by_id = _classes([ab[side] for ab in pairs])
            rows: list[list[int]] = [[] for _ in reps]
            for k, g in enumerate(of_pair):
                rows[g].append(first + k)
            ones = [len(r) for r in rows]
            for i, layout in enumerate(layouts):
                g = by_id.get(id(layout))
                rows[reps.index(layout) if g is None else g].append(x[decision][i])
            for layout, row, n in zip(reps, rows, ones):
                m.row_of((kind, edge.producer, edge.consumer, layout), row, [1.0] * n + [-1.0] * (len(row) - n),
                         0.0, 0.0)
    return memory


def _add_syncs(m: Model, problem: Problem, x) -> list[tuple[int, float]]:
    """The z columns and ``sync`` rows; returns (column, seconds) of the parameters' gradient
    all-reduces (the runtime runs those asynchronously: ``_add_overlap``)."""
    params = []
    for sync in problem.syncs:
        if sync.seconds <= 0:
            continue
        z = m.col(sync.seconds)
        if sync.param:
            params.append((z, sync.seconds))
        # z >= sum of a decision's triggering options: they exclude each other, so this is
        # valid, and tighter than one row per option.
        by_decision: dict[str, list[int]] = {}
        for key, i in sync.triggers:
            by_decision.setdefault(key, []).append(i)
        # A ZeRO-2 option of the parameter on this axis reduce-scatters the gradient instead
        # (priced with that option): it releases z.
        zero = ([(x[sync.param][j], 1.0) for j, (_, axes) in enumerate(problem.decisions[sync.param].options)
                 if sync.axis in axes] if sync.param else [])
        for key, options in by_decision.items():
            m.row(f"sync[{sync.tensor}@{sync.axis}]", [(z, 1.0)] + [(x[key][i], -1.0) for i in options] + zero,
                  0.0, float("inf"))
    return params


def _fold_recompute(m: Model, problem: Problem, x, edge_cols: dict, on: frozenset[str],
                    window: list[tuple[int, float]]) -> list:
    """Recompute with every term's r known (the pinned ones and ``on`` are 1, the others 0): w =
    x for the terms on, so each option and layout pair pays its recomputed forward and releases
    its saved bytes itself, and no r or w column is made (GPT-3 175B on m0=128,m1=4,m2=2: 23,419
    columns and 14,362 rows with r free, 10,802 and 1,682 folded). Returns the (column, -bytes)
    memory terms; appends each option's recomputed forward to ``window`` (``_add_overlap``)."""
    memory = []

    def fold(cols, per_col, forward: bool = False) -> None:
        for col, (extra_s, saved_bytes) in zip(cols, per_col):
            m.cost[col] += extra_s * TIME_SCALE
            if forward and extra_s:
                window.append((col, extra_s))
            if saved_bytes:
                memory.append((col, -saved_bytes))

    for term in problem.recompute:
        if not (term.pinned or term.key in on):
            continue
        for key, per_option in term.decisions.items():
            fold(x[key], [(extra, saved) for extra, saved, _ in per_option], forward=True)
        for idx, pairs in term.edges.items():
            if idx in edge_cols:
                edge_pairs, first = edge_cols[idx]
                fold(range(first, first + len(edge_pairs)), [pairs.get(ab, (0.0, 0.0, []))[:2] for ab in edge_pairs])
    return memory


def _add_recompute(m: Model, problem: Problem, x, edge_cols: dict,
                   window: list[tuple[int, float]]) -> tuple[dict[str, int], list]:
    """Recompute of block runs (``cost_model.recompute``): a binary r per run; for each of its
    decisions d, w_{d,i} = x_{d,i} r by ``sum_i w_{d,i} = r`` and ``w_{d,i} <= x_{d,i}``
    (rows ``recompute[...]``), the same over the layout pairs of its edges; w pays the forward
    again and releases the saved activation bytes in the memory row. Returns r's columns and
    the (column, -bytes) memory terms; appends the decisions' recomputed forwards to ``window``."""
    r_cols, memory = {}, []

    def product(name: str, r: int, gates: list[int], per_gate: list[tuple[float, float]],
                forward: bool = False) -> None:
        per_gate = per_gate[:len(gates)]  # one w per (gate, terms) pair, as zip pairs them
        ws = range(first := m.cols([extra_s for extra_s, _ in per_gate]), first + len(per_gate))
        le = f"recompute_le[{name}]"
        for w, gate, (extra_s, saved_bytes) in zip(ws, gates, per_gate):
            m.row_of(le, [w, gate], [1.0, -1.0], -float("inf"), 0.0)
            if forward and extra_s:
                window.append((w, extra_s))
            if saved_bytes:
                memory.append((w, -saved_bytes))
        m.row_of(f"recompute[{name}]", [*ws, r], [1.0] * len(ws) + [-1.0], 0.0, 0.0)

    runs: dict[str, list[int]] = {}
    for term in problem.recompute:
        r = r_cols[term.key] = m.col(0.0, integer=True)
        runs.setdefault(term.prefix.partition(":")[0], []).append(r)
        if term.pinned is not None:
            m.row(f"recompute_pin[{term.prefix}]", [(r, 1.0)], float(term.pinned), float(term.pinned))
        for key, per_option in term.decisions.items():
            if any(extra or saved for extra, saved, _ in per_option):
                product(f"{term.prefix}:{key}", r, x[key], [(extra, saved) for extra, saved, _ in per_option],
                        forward=True)
        for idx, pairs in term.edges.items():
            if idx not in edge_cols:
                continue
            edge_pairs, first = edge_cols[idx]
            gates = list(range(first, first + len(edge_pairs)))
            per_gate = [pairs.get(ab, (0.0, 0.0, []))[:2] for ab in edge_pairs]
            product(f"{term.prefix}:edge{idx}", r, gates, per_gate)
    for run, cols in runs.items():  # "auto": a run's whole block or its attention segment, not both
        if len(cols) > 1:
            m.row(f"recompute_one[{run}]", [(c, 1.0) for c in cols], 0.0, 1.0)
    return r_cols, memory


def _add_overlap(m: Model, problem: Problem, x, edge_cols: dict, param_syncs: list[tuple[int, float]],
                 recomputed: list[tuple[int, float]]) -> None:
    """The communication the runtime hides behind compute, as ``evaluate`` prices it
    (``cost_model/overlap.py``: hidden = overlap * min(async, window)): one column h >= 0 that
    the objective subtracts, under two rows, ``overlap_async``: h <= overlap * (the parameters'
    gradient all-reduces + ZeRO-3's prefetched gathers, ``_fused_gathers``) and
    ``overlap_window``: h <= overlap * (the forward and backward compute of every activation
    option + the forwards recompute runs again). A min is concave, so the minimising solver lifts
    h to it: at an integral point the objective is the step ``evaluate`` prices, and the
    relaxation stays under it. No overlap (the built-in GPU profiles): nothing is added."""
    overlap = problem.comm_overlap
    if overlap <= 0:
        return
    hidden_async: dict[int, float] = defaultdict(float)
    for col, seconds in param_syncs:
        hidden_async[col] += seconds
    for col, seconds in _fused_gathers(m, problem, x, edge_cols):
        hidden_async[col] += seconds
    if not any(hidden_async.values()):
        return
    window: dict[int, float] = defaultdict(float)
    for key, d in problem.decisions.items():
        if not d.is_param:
            for col, total, comm in zip(x[key], d.seconds, d.comm_seconds):
                window[col] += total - comm
    for col, seconds in recomputed:
        window[col] += seconds
    h = m.col(-1.0 / TIME_SCALE)  # in the model's time unit, subtracted from the objective
    m.upper[h] = float("inf")
    for name, terms in (("overlap_async", hidden_async), ("overlap_window", window)):
        m.row(name, [(h, 1.0)] + [(c, -overlap * v * TIME_SCALE) for c, v in terms.items() if v], -float("inf"), 0.0)


def _fused_gathers(m: Model, problem: Problem, x, edge_cols: dict) -> list[tuple[int, float]]:
    """(column, seconds) of each parameter gather the runtime fuses and prefetches (ZeRO-3,
    ``fsdp_pricing.fsdp_axis``): per layout pair that may fuse, v <= its edge column, <= the
    consumer's options that split the gather's axis and <= the parameter's options without
    ZeRO-2 there, so at an integral point v can be 1 exactly when the gather is fused."""
    out = []
    everywhere = tuple(range(problem.mesh.ndim))
    for idx, (pairs, first) in edge_cols.items():
        edge = problem.edges[idx]
        producer, consumer = problem.decisions[edge.producer], problem.decisions[edge.consumer]
        if not (edge.needs_grad and producer.is_param and edge.tensor):
            continue
        for k, (a, b) in enumerate(pairs):
            seconds = edge.seconds[(a, b)]
            axis = fsdp_axis(a, b, everywhere, ()) if seconds > 0 else None
            if axis is None:
                continue
            splits = [x[edge.consumer][i] for i, (st, _) in enumerate(consumer.options)
                      if edge.consumer_layouts[i] == b and axis in partial_grad_axes(st, problem.mesh)]
            keeps = [x[edge.producer][j] for j, (_, zero) in enumerate(producer.options)
                     if edge.producer_layouts[j] == a and axis not in zero]
            if not splits or not keeps:
                continue
            v = m.col(0.0)
            m.row_of(("fused", idx), [v, first + k], [1.0, -1.0], -float("inf"), 0.0)
            m.row_of(("fused_split", idx), [v, *splits], [1.0] + [-1.0] * len(splits), -float("inf"), 0.0)
            m.row_of(("fused_keep", idx), [v, *keeps], [1.0] + [-1.0] * len(keeps), -float("inf"), 0.0)
            out.append((v, seconds))
    return out


def _add_memory(m: Model, problem: Problem, x, budget_bytes: float | None,
                edge_memory: list[tuple[int, float]] = ()) -> None:
    if budget_bytes is None:
        return
    coeffs: dict[int, float] = {}  # a column once: a folded recompute term adds to an option's bytes
    for k, d in problem.decisions.items():
        for i, mem in enumerate(d.memory_bytes):
            if mem:
                coeffs[x[k][i]] = mem * MEMORY_SCALE
    for col, mem in edge_memory:
        coeffs[col] = coeffs.get(col, 0.0) + mem * MEMORY_SCALE
    m.row("memory", list(coeffs.items()), -float("inf"), budget_bytes * MEMORY_SCALE)


def _add_host_memory(m: Model, problem: Problem, x) -> None:
    """ZeRO-Offload: the host bytes of the parameters' options under the host's memory."""
    if problem.host is None:
        return
    coeffs = [(x[k][i], b * MEMORY_SCALE) for k, per_option in problem.host.per_option.items()
              for i, b in enumerate(per_option) if b]
    m.row("host_memory", coeffs, -float("inf"), problem.host.budget_bytes * MEMORY_SCALE)


@dataclass
class Built:
    """A problem's model and where its columns are."""

    model: Model
    x: dict[str, list[int]]  # decision key -> its options' columns
    recompute: dict[str, int]  # recompute term key -> its r column
    memory_rows: list[int]  # the first device memory row, the first host memory row, the end


def build_model(problem: Problem, budget_bytes: float | None, on: frozenset[str] | None = None) -> Built:
    """The model of ``problem`` under ``budget_bytes``; ``on``: the recompute terms fixed on (with
    the pinned ones; every other term off), folded into the options (``_fold_recompute``)."""
    m = Model()
    x = _add_decisions(m, problem)
    edge_cols: dict = {}
    edge_memory = _add_edges(m, problem, x, edge_cols)
    param_syncs = _add_syncs(m, problem, x)
    recomputed: list[tuple[int, float]] = []
    if on is None:
        r_cols, recompute_memory = _add_recompute(m, problem, x, edge_cols, recomputed)
    else:
        r_cols, recompute_memory = {}, _fold_recompute(m, problem, x, edge_cols, on, recomputed)
    _add_overlap(m, problem, x, edge_cols, param_syncs, recomputed)
    memory_rows = [len(m.row_lower)]
    _add_memory(m, problem, x, budget_bytes, edge_memory + recompute_memory)
    memory_rows.append(len(m.row_lower))
    _add_host_memory(m, problem, x)
    memory_rows.append(len(m.row_lower))
    return Built(m, x, r_cols, memory_rows)


# What the backends return: (status, column values or None, objective, lower bound, row duals or None)
Outcome = tuple[str, "np.ndarray | None", float, float, "np.ndarray | None"]

_BANNER_SHOWN = [False]


def _new_highs(highspy):
    """A Highs instance. The first one of a process prints HiGHS's banner on stdout before any
    option can silence it; that stdout is the user's report (or their JSON), so it goes to
    /dev/null for that moment."""
    if _BANNER_SHOWN[0]:
        return highspy.Highs()
    import os
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    _BANNER_SHOWN[0] = True
    return h


def solve_highs(m: Model, time_limit_s: float, relax: bool = False, presolve: bool = True) -> Outcome:
    """One HiGHS run: the LP relaxation (``relax``) or the MIP (to a relative gap of 1e-4)."""
    import highspy

    h = _new_highs(highspy)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", 1e-4)
    if not presolve:
        h.setOptionValue("presolve", "off")
    n = len(m.cost)
    inf = highspy.kHighsInf
    h.addCols(n, np.asarray(m.cost), np.zeros(n), np.asarray(m.upper), 0, np.array([], dtype=np.int32),
              np.array([], dtype=np.int32), np.array([]))
    ints = np.flatnonzero(np.asarray(m.integer) & (not relax)).astype(np.int32)
    if len(ints):
        h.changeColsIntegrality(len(ints), ints, np.full(len(ints), highspy.HighsVarType.kInteger))
    rows, cols, vals = m.sorted_entries()
    starts = np.searchsorted(rows, np.arange(len(m.row_lower))).astype(np.int32)
    h.addRows(len(m.row_lower), np.clip(np.asarray(m.row_lower), -inf, inf), np.clip(np.asarray(m.row_upper), -inf, inf),
              len(rows), starts, cols.astype(np.int32), vals)
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    if status in ("Infeasible", "Primal infeasible or unbounded"):
        return "Infeasible", None, float("nan"), float("nan"), None
    if info.primal_solution_status == 0:  # no feasible point found in time
        return status, None, float("nan"), float("nan"), None
    solution = h.getSolution()
    values = np.asarray(solution.col_value)
    duals = np.asarray(solution.row_dual) if relax and status == "Optimal" and solution.dual_valid else None
    objective = float(info.objective_function_value)
    bound = objective if relax else float(info.mip_dual_bound)
    if not (bound == bound and abs(bound) < 1e30):
        bound = objective if status == "Optimal" else float("nan")
    return ("Optimal" if status == "Optimal" else status), values, objective, min(bound, objective), duals


def solve_cbc(m: Model, time_limit_s: float, relax: bool = False, presolve: bool = True) -> Outcome:
    """One CBC run through PuLP (the fallback where highspy is missing), as ``solve_highs``.
    ``presolve`` is HiGHS's option; CBC takes it for the common signature and ignores it."""
    import pulp

    def build(relax: bool):
        prob = pulp.LpProblem("autopar_strategy", pulp.LpMinimize)
        cols = [pulp.LpVariable(f"c{i}", 0, ub if ub < float("inf") else None,
                                cat="Continuous" if (relax or not integer) else "Integer")
                for i, (ub, integer) in enumerate(zip(m.upper, m.integer))]
        prob.setObjective(pulp.LpAffineExpression([(v, c) for v, c in zip(cols, m.cost) if c]))
        rows: dict[int, list] = {}
        for r, c, v in m.entries:
            rows.setdefault(r, []).append((cols[c], v))
        for r, coeffs in rows.items():
            expr = pulp.LpAffineExpression(coeffs)
            lo, up = m.row_lower[r], m.row_upper[r]
            if lo == up:
                prob += expr == lo
            else:
                if lo > -float("inf"):
                    prob += expr >= lo
                if up < float("inf"):
                    prob += expr <= up
        return prob, cols

    prob, cols = build(relax=relax)
    status = pulp.LpStatus[prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=int(max(1, time_limit_s))))]
    if status == "Infeasible":
        return "Infeasible", None, float("nan"), float("nan"), None
    values = np.array([v.value() or 0.0 for v in cols])
    objective = float(prob.objective.value() or 0.0)
    relaxed, _ = build(relax=True)
    relaxed.solve(pulp.PULP_CBC_CMD(msg=False))
    return status, values, objective, min(float(relaxed.objective.value() or 0.0), objective), None
