"""Alpha-beta times of ring collectives over one :class:`~autopar.mesh.Link`.

On ``n`` ranks with link bandwidth ``B`` (the per-device *bus* bandwidth, as nccl-tests
reports it) and per-hop latency ``a``, a ring algorithm moves the data in ``n - 1`` (or
``2(n - 1)``) steps. Formulas: NVIDIA nccl-tests doc/PERFORMANCE.md (bus bandwidth factors)
and NCCL src/graph/tuning.cc (latency per step), summarised in FACTS.md:

    all-reduce                              2(n-1)/n * S/B + 2(n-1) a
    all-gather, reduce-scatter, all-to-all   (n-1)/n * S/B +  (n-1) a
    broadcast, reduce (pipelined ring)                S/B +  (n-1) a
    point-to-point                                    S/B +        a

Sizes are bytes per rank; which size ``S`` is (input or output) is spelled out in each
function. Every function returns 0.0 when ``n == 1`` or no bytes move. ``B`` and ``a`` are
``link.rates(collective, n)``: a calibrated link may carry measured rates per collective and
group size (``Link.per_collective``), else its one pair.
"""

from __future__ import annotations

from typing import Literal, get_args

from ..mesh import Link

__all__ = [
    "Collective",
    "COLLECTIVES",
    "all_reduce_s",
    "all_gather_s",
    "reduce_scatter_s",
    "all_to_all_s",
    "broadcast_s",
    "p2p_s",
    "collective_s",
    "collective_latency_s",
    "unit_collective_s",
    "bytes_sent_per_rank",
]

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "p2p"]
COLLECTIVES: tuple[str, ...] = get_args(Collective)


def _check(nbytes: float, n: int) -> None:
    if n < 1 or int(n) != n:
        raise ValueError(f"a collective needs a positive whole number of ranks, got n={n!r}")
    if nbytes < 0:
        raise ValueError(f"a collective cannot move a negative number of bytes ({nbytes!r})")


def all_reduce_s(bytes_per_rank: float, n: int, link: Link) -> float:
    """Ring all-reduce of ``bytes_per_rank`` (the full tensor each rank holds, in and out).

    ``2(n-1)/n * S/B + 2(n-1) a``: a reduce-scatter then an all-gather, each ``n - 1`` steps
    of ``S/n`` bytes (nccl-tests PERFORMANCE.md, busBW = algBW * 2(n-1)/n; FACTS.md).
    """
    _check(bytes_per_rank, n)
    if n == 1 or bytes_per_rank == 0:
        return 0.0
    steps = 2 * (n - 1)
    bandwidth, latency = link.rates("all_reduce", n)
    return steps / n * bytes_per_rank / bandwidth + steps * latency


def all_gather_s(bytes_out_per_rank: float, n: int, link: Link) -> float:
    """Ring all-gather whose result is ``bytes_out_per_rank`` on every rank (input is ``S/n``).

    ``(n-1)/n * S/B + (n-1) a`` (nccl-tests PERFORMANCE.md, busBW = algBW * (n-1)/n with
    algBW over the output size; FACTS.md).
    """
    _check(bytes_out_per_rank, n)
    if n == 1 or bytes_out_per_rank == 0:
        return 0.0
    bandwidth, latency = link.rates("all_gather", n)
    return (n - 1) / n * bytes_out_per_rank / bandwidth + (n - 1) * latency


def reduce_scatter_s(bytes_in_per_rank: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of a full ``bytes_in_per_rank`` input per rank (output is ``S/n``).

    ``(n-1)/n * S/B + (n-1) a`` (nccl-tests PERFORMANCE.md, busBW = algBW * (n-1)/n with
    algBW over the input size; FACTS.md).
    """
    _check(bytes_in_per_rank, n)
    if n == 1 or bytes_in_per_rank == 0:
        return 0.0
    bandwidth, latency = link.rates("reduce_scatter", n)
    return (n - 1) / n * bytes_in_per_rank / bandwidth + (n - 1) * latency


def all_to_all_s(bytes_per_rank: float, n: int, link: Link) -> float:
    """All-to-all where each rank holds ``bytes_per_rank`` and keeps ``1/n`` of it.

    ``(n-1)/n * S/B + (n-1) a``: each rank sends ``S/n`` to each of ``n - 1`` peers
    (nccl-tests PERFORMANCE.md, alltoall busBW = algBW * (n-1)/n; FACTS.md).
    """
    _check(bytes_per_rank, n)
    if n == 1 or bytes_per_rank == 0:
        return 0.0
    bandwidth, latency = link.rates("all_to_all", n)
    return (n - 1) / n * bytes_per_rank / bandwidth + (n - 1) * latency


def broadcast_s(nbytes: float, n: int, link: Link) -> float:
    """Pipelined ring broadcast of ``nbytes`` from one rank to all.

    ``S/B + (n-1) a``: the data streams through the ring in chunks, so bandwidth costs
    ``S/B`` (nccl-tests PERFORMANCE.md, broadcast busBW = algBW; FACTS.md) and the first
    chunk takes ``n - 1`` hops to reach the last rank.
    """
    _check(nbytes, n)
    if n == 1 or nbytes == 0:
        return 0.0
    bandwidth, latency = link.rates("broadcast", n)
    return nbytes / bandwidth + (n - 1) * latency


def p2p_s(nbytes: float, link: Link) -> float:
    """One send/recv of ``nbytes`` over ``link``: ``S/B + a`` (one hop)."""
    _check(nbytes, 2)
    if nbytes == 0:
        return 0.0
    bandwidth, latency = link.rates("p2p", 2)
    return nbytes / bandwidth + latency


def collective_s(collective: Collective, nbytes: float, n: int, link: Link) -> float:
    """Dispatch by name; ``nbytes`` means what the named function's first argument means."""
    if collective == "all_reduce":
        return all_reduce_s(nbytes, n, link)
    if collective == "all_gather":
        return all_gather_s(nbytes, n, link)
    if collective == "reduce_scatter":
        return reduce_scatter_s(nbytes, n, link)
    if collective == "all_to_all":
        return all_to_all_s(nbytes, n, link)
    if collective in ("broadcast", "reduce"):  # a pipelined ring reduce is the broadcast run backwards
        return broadcast_s(nbytes, n, link)
    if collective == "p2p":
        _check(nbytes, n)
        return 0.0 if n == 1 else p2p_s(nbytes, link)
    raise ValueError(f"unknown collective {collective!r}; pick one of {', '.join(COLLECTIVES)}")


def unit_collective_s(collective: Collective, nbytes: float, n: int, link: Link, unit_share: float) -> float:
    """One tensor's share of a collective the runtime runs once for a whole unit of tensors (a
    ZeRO unit's flat all-gather or reduce-scatter, ``runtime.fsdp`` / ``runtime.zero2``): the
    bandwidth term in full (the ring formulas are linear in the payload), the latency term
    ``unit_share`` times (the tensor's share of the unit's elements), so the shares of one unit
    sum to one collective's latency. ``unit_share=1``: a collective of its own."""
    full = collective_s(collective, nbytes, n, link)
    if full == 0.0 or collective in ("broadcast", "reduce", "p2p"):
        return full
    return full - collective_latency_s(collective, n, link) * (1.0 - unit_share)


def collective_latency_s(collective: Collective, n: int, link: Link) -> float:
    """The latency term of ``collective_s`` (its ``a`` hops): what the collective costs however
    few bytes it moves. A pipeline's micro-batch pays it in full (``autopar.pipeline_parts``)."""
    if n == 1:
        return 0.0
    hops = 2 * (n - 1) if collective == "all_reduce" else 1 if collective == "p2p" else n - 1
    return hops * link.rates(collective, n)[1]


def bytes_sent_per_rank(collective: Collective, nbytes: float, n: int) -> float:
    """Bytes one rank sends in the ring algorithm, to compare with measured traffic.

    ``nbytes`` means what it means for the matching ``*_s`` function: all_reduce
    ``2(n-1)/n S``; all_gather ``(n-1)/n S_out``; reduce_scatter ``(n-1)/n S_in``;
    all_to_all ``(n-1)/n S``; broadcast ``S`` (each rank but the last forwards the whole
    payload in a pipelined ring); reduce ``S`` (the same stream backwards); p2p ``S`` (the sender). Zero when ``n == 1``.
    Source: nccl-tests PERFORMANCE.md bus-bandwidth factors (FACTS.md).
    """
    _check(nbytes, n)
    if n == 1 or nbytes == 0:
        return 0.0
    if collective == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * nbytes
    if collective in ("broadcast", "reduce", "p2p"):
        return float(nbytes)
    raise ValueError(f"unknown collective {collective!r}; pick one of {', '.join(COLLECTIVES)}")
