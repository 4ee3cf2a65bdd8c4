"""Per-layer costs of 1D, 2D, 2.5D and 3D tensor parallelism: the published table, and what
autopar's layouts send.

Part 1: the table
-----------------
:func:`table_row` (and ``table_1d``, ``table_2d``, ``table_2p5d``, ``table_3d``) returns one
row of the table in ``FACTS.md``, section "Tensor-parallel communication per layer". That table
comes from Colossal-AI's documentation (``docs/source/en/features/1D_tensor_parallel.md``,
``2D_tensor_parallel.md``, ``2p5D_tensor_parallel.md`` and ``3D_tensor_parallel.md``, the
"Efficiency" tables, forward + backward, ring collectives). Each value is copied from the table
unchanged, as an exact :class:`fractions.Fraction`:

==================  ======  ==========  =========  ==========  ======================  =======
layout              devices compute     param mem  activ. mem  bandwidth               latency
==================  ======  ==========  =========  ==========  ======================  =======
1D (Megatron)       P       1/P         1/P        1           2(P-1)/P                2(P-1)
2D (SUMMA/Optimus)  q^2     1/q^2       1/q^2      1/q^2       6(q-1)/q                6(q-1)
2.5D (Tesseract)    d q^2   1/(d q^2)   1/q^2      1/(d q^2)   3(q-1)(d+1)/(d q)       6(q-1)
3D                  q^3     1/q^3       1/q^3      1/q^3       6(q-1)/q^3              6(q-1)
==================  ======  ==========  =========  ==========  ======================  =======

The docs do not say what unit the bandwidth column uses (the whole activation for 1D; some
per-device block for the others). Only ratios within one row, as P, q or d change, can
therefore be compared with bytes.

Part 2: what autopar's layouts send for one linear layer
--------------------------------------------------------
The other functions give closed forms for the bytes one device sends per training step (forward
and backward) for one linear layer ``Y = X W`` when it runs as autopar lays it out. Notation:
X is ``m x k`` (m rows = batch x sequence), W is ``k x n`` (torch stores its transpose, ``n x
k``), Y is ``m x n``, and ``e`` is the number of bytes per element (4 for fp32). ``x_grad``
says whether X needs a gradient; that holds for every layer except one fed by the model's
input.

Bytes sent per rank on ``r`` ranks use the ring figures of ``cost_model.comm``: all-gather
sends ``(r-1)/r`` of its output, reduce-scatter ``(r-1)/r`` of its input, all-reduce
``2(r-1)/r`` of the tensor, and broadcast and reduce send the whole payload ``S``.

The layouts below are the ones the planner picks for each family (pinned by ``strategy=``
and ``mesh=``) on a stack of MLP blocks ``Linear(h, f) -> Linear(f, h)`` with no biases. Such a
block holds two layers, and the two take different roles (called ``"column"`` and ``"row"``
here, after Megatron). ``tests/test_tp_formulas.py`` checks that the planner makes these choices
and that its predicted bytes equal these formulas.

**1D, P ranks** (``megatron``, mesh ``tp=P``). This is Megatron's pairing. The ``column``
layer splits W on n; X arrives whole on every rank. The ``row`` layer splits W on k, and X
arrives split on k from the column layer. Neither weight moves.

* column: the forward sends nothing. In the backward each rank holds only its ``n/P`` share of
  ``dY W^T``, so dX is a partial sum and needs an all-reduce: ``2(P-1)/P * e m k``.
* row: the forward output is a partial sum. It is all-reduced so the next block gets it whole:
  ``2(P-1)/P * e m n``. The backward sends nothing.

Each layer does one all-reduce of an activation with m rows. That matches the table's
``2(P-1)/P`` with the whole activation as its unit. There is no ``1/P`` factor.

**2D, q_r x q_c** (``2d``, mesh ``row x col``), plain lowering. Along ``col`` this is Megatron
as above: the column layer splits n on ``col``, the row layer splits k on ``col``. The rows of
X and Y are split over ``row``. Each weight is stored split on both axes (``1/(q_r q_c)``). It
is used as a panel ``Wp = e k n / q_c``, whole along ``row``, so along ``row`` the weights run
as ZeRO-3/FSDP does:

* weight, per layer: the forward all-gathers the panel over ``row``, ``(q_r-1)/q_r * Wp``. When
  X needs a gradient the op saved the panel, and ``runtime.fsdp`` keeps only the shard between
  the passes, so the backward gathers it again: another ``(q_r-1)/q_r * Wp``. The gradient is
  reduce-scattered over ``row``: ``(q_r-1)/q_r * Wp``. (This is FSDP's ``3 Psi (N-1)/N``.)
* activation, column layer: dX is partial over ``col`` and is all-reduced there:
  ``2(q_c-1)/q_c * e (m/q_r) k``.
* activation, row layer: Y is partial over ``col`` and is all-reduced there:
  ``2(q_c-1)/q_c * e (m/q_r) n``.

So per device the activation traffic falls like ``(q-1)/q * 1/q``, and so does the weight
traffic.

**2.5D, d x q x q** (``2.5d``, mesh ``dep x row x col``), plain lowering. This is 2D with the
rows split over ``dep`` as well (``m -> m/(d q_r)``). The weights are replicated over ``dep``,
so their gradients are all-reduced there: ``2(d-1)/d * Wp`` per layer. The cost model runs
that all-reduce on the gathered panel ``Wp``, before the reduce-scatter over ``row``.
Tesseract reduces the stored ``1/q^2`` block, which is ``1/q_r`` of this.

**SUMMA** (2D and 2.5D, the variant from ``tp_families.summa_strategies``; the planner picks it
on some meshes, e.g. ``dep=4,row=2,col=2``). X and W stay as they are stored: X's rows on
``dep x row`` and its k on ``col``; W's k on ``row`` and its n on ``col``. K is processed in
``L = lcm(q_r, q_c)`` panels of ``k/L`` columns. Over all panels the X part is
``A = e (m/(d q_r)) k`` and the W part is ``B = e k n / q_c``.

* forward: broadcast ``A`` over ``col`` and ``B`` over ``row``.
* backward, if X needs a gradient: broadcast ``B`` again and reduce ``A`` (dX) over ``col``.
* backward, for W's gradient: broadcast ``A`` again and reduce ``B`` (dW) over ``row``.
* 2.5D adds an all-reduce of the stored block over ``dep``: ``2(d-1)/d * e k n/(q_r q_c)``.

Y comes out in X's layout, so nothing is resharded between layers. With both gradients this
makes six collectives per layer, as the table counts them. The factor is 1 where the table has
``(q-1)/q``, because ``cost_model.comm`` counts a pipelined broadcast or reduce as ``S`` per
rank. ``S`` is what every rank but the last in the ring sends. With SUMMA's root rotating
through all q ranks, each rank's average is ``(q-1)/q * S``.

**3D, q x q x q** (``3d``, mesh ``x y z``). The rows of X are split over ``x``. W is used with
k split over one of ``y``, ``z`` (call it ``a``) and n split over the other (``b``). It is
stored split over ``x`` too, on the same dim that ``a`` cuts. The two layers of a block swap
``a`` and ``b`` (fc1: k on y, n on z; fc2: k on z, n on y), so Y's split on ``b`` becomes the
next layer's k split without any reshard.

* weight, per layer: a dim cut by two axes is cut outer axis first (DTensor's order), so
  gathering over ``x`` first needs the inner cut over ``a`` gathered, and afterwards ``a``
  cuts it again. The forward therefore sends ``(q-1)/q * e k n/q^2`` (all-gather over ``a``)
  plus ``(q-1)/q * e k n/q`` (all-gather over ``x`` of a ``1/q`` piece, not ``1/q^2``). The
  backward all-gathers the gradient of the re-cut over ``a``: ``(q-1)/q * e k n/q``. The
  gradient is all-reduced over ``x``: ``2(q-1)/q * e k n/q^2``. It is not reduce-scattered,
  because the gather over ``x`` is not the reshard's last step, so ZeRO-3's fusion does not
  apply (and there is no backward re-gather either).
* activation: X is whole over ``b``, so Y is partial over ``a``. Y is all-reduced there, since
  the next layer needs it whole over that axis: ``2(q-1)/q * e m n/q^2``. In the backward dX
  is partial over ``b`` and is all-reduced there: ``2(q-1)/q * e m k/q^2`` (if X needs a
  gradient).

Colossal-AI's maintainers describe this all-reduce design as the alternative to the paper's
(hpcaitech/colossalai issue #131). The paper all-gathers X and reduce-scatters Y, which keeps
activations at ``1/q^3``. Here they are ``1/q^2``, whole along one axis. The activation traffic
still falls like ``(q-1)/q^3``, as the table's does. The weight traffic does not: its
``k n/q`` terms fall like ``(q-1)/q^2``.

Every formula is exact for the cost model (no rounding) when every split divides. ``*_terms``
functions list the collectives one by one; ``*_bytes`` functions sum them per collective, as
``Plan.comm_bytes`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable

__all__ = [
    "LAYOUTS", "TableRow", "table_1d", "table_2d", "table_2p5d", "table_3d", "table_row",
    "Term", "linear_terms", "linear_bytes", "mlp_block_terms", "mlp_block_bytes", "by_collective", "by_tensor",
    "param_fraction", "compute_fraction", "block_input_fraction",
]

LAYOUTS = ("1d", "2d", "2.5d", "3d")


# --- Part 1: the published table ------------------------------------------------------------

@dataclass(frozen=True)
class TableRow:
    """One row of the table (FACTS.md, from Colossal-AI's docs): per device, per layer,
    forward + backward. The fractions are of the unsplit layer's compute, parameters and
    activations; ``bandwidth`` and ``latency`` are the table's communication terms as given."""

    layout: str
    devices: int
    compute: Fraction
    param_memory: Fraction
    activation_memory: Fraction
    bandwidth: Fraction
    latency: int


def _positive(name: str, v: int) -> int:
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return v


def table_1d(P: int) -> TableRow:
    """1D (Megatron) on P devices: compute 1/P, param mem 1/P, activation mem 1,
    bandwidth 2(P-1)/P, latency 2(P-1)."""
    P = _positive("P", P)
    return TableRow("1d", P, Fraction(1, P), Fraction(1, P), Fraction(1), Fraction(2 * (P - 1), P), 2 * (P - 1))


def table_2d(q: int) -> TableRow:
    """2D (SUMMA, Optimus) on q^2 devices: compute, param mem and activation mem 1/q^2,
    bandwidth 6(q-1)/q, latency 6(q-1)."""
    q = _positive("q", q)
    f = Fraction(1, q * q)
    return TableRow("2d", q * q, f, f, f, Fraction(6 * (q - 1), q), 6 * (q - 1))


def table_2p5d(q: int, d: int) -> TableRow:
    """2.5D (Tesseract) on d q^2 devices: compute 1/(d q^2), param mem 1/q^2, activation mem
    1/(d q^2), bandwidth 3(q-1)(d+1)/(d q), latency 6(q-1)."""
    q, d = _positive("q", q), _positive("d", d)
    return TableRow("2.5d", d * q * q, Fraction(1, d * q * q), Fraction(1, q * q), Fraction(1, d * q * q),
                    Fraction(3 * (q - 1) * (d + 1), d * q), 6 * (q - 1))


def table_3d(q: int) -> TableRow:
    """3D on q^3 devices: compute, param mem and activation mem 1/q^3, bandwidth 6(q-1)/q^3,
    latency 6(q-1)."""
    q = _positive("q", q)
    f = Fraction(1, q ** 3)
    return TableRow("3d", q ** 3, f, f, f, Fraction(6 * (q - 1), q ** 3), 6 * (q - 1))


def table_row(layout: str, *, P: int | None = None, q: int | None = None, d: int | None = None) -> TableRow:
    """The table's row for ``layout`` ("1d": P; "2d", "3d": q; "2.5d": q and d)."""
    if layout == "1d":
        return table_1d(P)
    if layout == "2d":
        return table_2d(q)
    if layout == "2.5d":
        return table_2p5d(q, d)
    if layout == "3d":
        return table_3d(q)
    raise ValueError(f"unknown layout {layout!r}; pick one of {', '.join(LAYOUTS)}")


# --- Part 2: what autopar's layouts send ----------------------------------------------------

@dataclass(frozen=True)
class Term:
    """One collective of the derivation: ``nbytes`` is what one device sends (ring figures of
    ``cost_model.comm``) over ``ranks`` devices of mesh axis ``axis``; ``tensor`` is
    "activation" or "weight"; ``why`` says which step of the layout it is."""

    collective: str
    axis: str
    ranks: int
    tensor: str
    phase: str
    nbytes: float
    why: str


def _ag(r: int, out: float) -> float:  # all-gather: (r-1)/r of the gathered output
    return (r - 1) / r * out


def _rs(r: int, inp: float) -> float:  # reduce-scatter: (r-1)/r of the input
    return (r - 1) / r * inp


def _ar(r: int, s: float) -> float:  # all-reduce: 2(r-1)/r of the tensor
    return 2 * (r - 1) / r * s


def _keep(terms: Iterable[Term]) -> list[Term]:
    return [t for t in terms if t.ranks > 1 and t.nbytes > 0]


def _terms_1d(m, k, n, P, role, x_grad, e) -> list[Term]:
    if role == "column":
        return _keep([Term("all_reduce", "tp", P, "activation", "bwd", _ar(P, e * m * k) if x_grad else 0.0,
                           "dX is a partial sum over the n split")])
    if role == "row":
        return _keep([Term("all_reduce", "tp", P, "activation", "fwd", _ar(P, e * m * n),
                           "Y is a partial sum over the k split")])
    raise ValueError(f"role must be 'column' or 'row', got {role!r}")


def _terms_grid_plain(m, k, n, d, qr, qc, role, x_grad, e) -> list[Term]:
    panel = e * k * n / qc  # W whole along row, split along col, as the matmul uses it
    rows = m / (d * qr)
    terms = [
        Term("all_gather", "row", qr, "weight", "fwd", _ag(qr, panel), "gather the stored weight panel (ZeRO-3)"),
        Term("all_gather", "row", qr, "weight", "bwd", _ag(qr, panel) if x_grad else 0.0,
             "gather it again for dX (the op saved it)"),
        Term("reduce_scatter", "row", qr, "weight", "bwd", _rs(qr, panel), "gradient of the panel"),
        Term("all_reduce", "dep", d, "weight", "bwd", _ar(d, panel), "gradient over the depth replicas (panel)"),
    ]
    if role == "column":
        terms.append(Term("all_reduce", "col", qc, "activation", "bwd", _ar(qc, e * rows * k) if x_grad else 0.0,
                          "dX partial over col (n split there)"))
    elif role == "row":
        terms.append(Term("all_reduce", "col", qc, "activation", "fwd", _ar(qc, e * rows * n),
                          "Y partial over col (k split there)"))
    else:
        raise ValueError(f"role must be 'column' or 'row', got {role!r}")
    return _keep(terms)


def _terms_grid_summa(m, k, n, d, qr, qc, x_grad, w_grad, e) -> list[Term]:
    # all panels together: L = lcm(qr, qc) panels of k/L columns each
    a = e * (m / (d * qr)) * k  # X's panels, broadcast over col
    b = e * k * n / qc  # W's panels, broadcast over row
    terms = [
        Term("broadcast", "col", qc, "activation", "fwd", a, "X panels"),
        Term("broadcast", "row", qr, "weight", "fwd", b, "W panels"),
    ]
    if x_grad:
        terms += [Term("broadcast", "row", qr, "weight", "bwd", b, "W panels again, for dX"),
                  Term("reduce", "col", qc, "activation", "bwd", a, "dX panels onto their owners")]
    if w_grad:
        terms += [Term("broadcast", "col", qc, "activation", "bwd", a, "X panels again, for dW"),
                  Term("reduce", "row", qr, "weight", "bwd", b, "dW panels onto their owners")]
    terms.append(Term("all_reduce", "dep", d, "weight", "bwd", _ar(d, e * k * n / (qr * qc)),
                      "gradient of the stored block over the depth replicas"))
    return _keep(terms)


def _terms_3d(m, k, n, q, x_grad, e) -> list[Term]:
    w = e * k * n
    return _keep([
        Term("all_gather", "a", q, "weight", "fwd", _ag(q, w / q ** 2), "gather the inner cut of the x-split dim"),
        Term("all_gather", "x", q, "weight", "fwd", _ag(q, w / q), "gather the stored split over x (a 1/q piece)"),
        Term("all_gather", "a", q, "weight", "bwd", _ag(q, w / q), "backward of cutting over a again"),
        Term("all_reduce", "x", q, "weight", "bwd", _ar(q, w / q ** 2), "gradient over x (no ZeRO-3 fusion)"),
        Term("all_reduce", "a", q, "activation", "fwd", _ar(q, e * m * n / q ** 2), "Y partial over a (k split)"),
        Term("all_reduce", "b", q, "activation", "bwd", _ar(q, e * m * k / q ** 2) if x_grad else 0.0,
             "dX partial over b (n split)"),
    ])


def linear_terms(layout: str, m: int, k: int, n: int, *, P: int | None = None, q: int | None = None,
                 d: int | None = None, q_col: int | None = None, role: str = "column", algorithm: str = "plain",
                 x_grad: bool = True, w_grad: bool = True, elem_bytes: float = 4) -> list[Term]:
    """The collectives one device runs for one linear layer ``Y = X W`` (X: m x k, W: k x n),
    forward and backward, as autopar's ``layout`` runs it (module docstring).

    ``layout``: "1d" (P), "2d" (q rows; ``q_col`` columns, default q), "2.5d" (q, d; ``q_col``),
    "3d" (q). ``role``: "column" or "row", the layer's place in a Megatron pair (1D, plain 2D
    and 2.5D). ``algorithm``: "plain" (whole-panel gathers) or "summa" (2D, 2.5D).
    ``x_grad``: X needs a gradient. ``w_grad``: W needs one (only SUMMA's sends depend on it;
    the plain layouts assume it). Zero-byte collectives (an axis of size 1) are left out."""
    e = elem_bytes
    if layout == "1d":
        return _terms_1d(m, k, n, _positive("P", P), role, x_grad, e)
    if layout in ("2d", "2.5d"):
        q = _positive("q", q)
        depth = 1 if layout == "2d" else _positive("d", d)
        qc = q if q_col is None else _positive("q_col", q_col)
        if algorithm == "plain":
            return _terms_grid_plain(m, k, n, depth, q, qc, role, x_grad, e)
        if algorithm == "summa":
            return _terms_grid_summa(m, k, n, depth, q, qc, x_grad, w_grad, e)
        raise ValueError(f"algorithm must be 'plain' or 'summa', got {algorithm!r}")
    if layout == "3d":
        return _terms_3d(m, k, n, _positive("q", q), x_grad, e)
    raise ValueError(f"unknown layout {layout!r}; pick one of {', '.join(LAYOUTS)}")


def by_collective(terms: Iterable[Term]) -> dict[str, float]:
    """Bytes sent per device by collective name, as ``Plan.comm_bytes`` keys them."""
    out: dict[str, float] = {}
    for t in terms:
        out[t.collective] = out.get(t.collective, 0.0) + t.nbytes
    return out


def by_tensor(terms: Iterable[Term]) -> dict[str, float]:
    """Bytes sent per device for activations and for weights."""
    out = {"activation": 0.0, "weight": 0.0}
    for t in terms:
        out[t.tensor] += t.nbytes
    return out


def linear_bytes(layout: str, m: int, k: int, n: int, **params) -> dict[str, float]:
    """``by_collective(linear_terms(...))``: one linear layer's bytes sent per device."""
    return by_collective(linear_terms(layout, m, k, n, **params))


def mlp_block_terms(layout: str, m: int, h: int, f: int, **params) -> list[Term]:
    """An MLP block ``Linear(h, f) -> Linear(f, h)`` (no biases): the first layer in the
    ``column`` role, the second in the ``row`` role (3D: the two swap their k and n axes; SUMMA:
    the same layout for both). ``params`` as :func:`linear_terms` (not ``role``)."""
    return (linear_terms(layout, m, h, f, role="column", **params)
            + linear_terms(layout, m, f, h, role="row", **params))


def mlp_block_bytes(layout: str, m: int, h: int, f: int, **params) -> dict[str, float]:
    return by_collective(mlp_block_terms(layout, m, h, f, **params))


# --- fractions per device, as autopar's layouts hold them -----------------------------------

def param_fraction(layout: str, *, P: int | None = None, q: int | None = None, d: int | None = None) -> Fraction:
    """Share of each weight matrix one device stores: the families store every weight split
    over the grid (2.5D: replicated over depth). The same as the table's param-mem column."""
    return table_row(layout, P=P, q=q, d=d).param_memory


def compute_fraction(layout: str, *, P: int | None = None, q: int | None = None, d: int | None = None) -> Fraction:
    """Share of a linear layer's FLOPs one device runs: every layout splits each matmul over
    every mesh axis (1 / devices), as the table's compute column."""
    return Fraction(1, table_row(layout, P=P, q=q, d=d).devices)


def block_input_fraction(layout: str, *, P: int | None = None, q: int | None = None, d: int | None = None,
                         algorithm: str = "plain") -> Fraction:
    """Share of the activation entering an MLP block (the first layer's X, as that layer uses
    and saves it) that one device holds. This is where autopar's layouts differ from the
    table's activation column:

    * 1D: whole (1), as in the table;
    * 2D/2.5D plain: rows split over row (and dep), whole along col, which is the Megatron
      axis: ``1/q`` (2.5D ``1/(d q)``), not ``1/q^2``. The middle activation (between the two
      layers) is ``1/q^2``;
    * SUMMA: split on both grid axes, ``1/q^2`` (2.5D ``1/(d q^2)``), as in the table;
    * 3D: whole along one axis, ``1/q^2`` (the all-reduce design), not ``1/q^3``."""
    if layout == "1d":
        return Fraction(1)
    if layout in ("2d", "2.5d"):
        depth = 1 if layout == "2d" else d
        return Fraction(1, depth * q * (q if algorithm == "summa" else 1))
    if layout == "3d":
        return Fraction(1, q * q)
    raise ValueError(f"unknown layout {layout!r}; pick one of {', '.join(LAYOUTS)}")
