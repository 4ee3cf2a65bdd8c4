"""Price of a parameter gradient's all-reduce when it runs in a bucket (``runtime.grad_buckets``).

The runtime all-reduces replicated parameters' gradients in buckets of ``GRAD_BUCKET_BYTES``
(DDP's default size), so a bucket pays the collective's latency once for all the gradients in
it. Priced per tensor, as the problem's sync terms are, that is the ring formula's bandwidth
term plus its latency term times the tensor's share of a bucket (``min(1, S / bucket)``):
linear in the bytes, so the sum over a bucket's tensors is one latency, and a tensor larger
than a bucket pays one per tensor (FACTS.md: all-reduce ``2(n-1)/n S/B + 2(n-1) a``).
"""

from __future__ import annotations

from autopar.mesh import Link

from .comm import all_reduce_s

__all__ = ["GRAD_BUCKET_BYTES", "FIRST_GRAD_BUCKET_BYTES", "bucketed_all_reduce_s", "alone_in_bucket"]

GRAD_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default
FIRST_GRAD_BUCKET_BYTES = 1 * 2**20  # DDP's first, small bucket: communication starts early


def bucketed_all_reduce_s(bytes_per_rank: float, n: int, link: Link) -> float:
    """Seconds of one tensor's share of a bucketed all-reduce (see module doc)."""
    total = all_reduce_s(bytes_per_rank, n, link)
    if total == 0.0:
        return 0.0
    latency = 2 * (n - 1) * link.rates("all_reduce", n)[1]
    return total - latency + latency * min(1.0, bytes_per_rank / GRAD_BUCKET_BYTES)


def alone_in_bucket(params: list[tuple[str, float, tuple]]) -> set[str]:
    """The parameters that ``runtime.grad_buckets`` puts in a bucket of their own, which then
    has no flat buffer (their ``.grad`` is all-reduced in place). ``params``: (name, wire bytes,
    sync key: the axes it is all-reduced over) in the order the runtime fills buckets (reverse
    parameter order); as there, a bucket is open per key until it holds ``FIRST_GRAD_BUCKET_BYTES``
    (the first bucket made) or ``GRAD_BUCKET_BYTES``."""
    buckets: list[list[str]] = []
    open_by_key: dict[tuple, tuple[int, float]] = {}
    for name, nbytes, key in params:
        b, filled = open_by_key.get(key, (len(buckets), 0.0))
        if b == len(buckets):
            buckets.append([])
        buckets[b].append(name)
        filled += nbytes
        if filled >= (FIRST_GRAD_BUCKET_BYTES if b == 0 else GRAD_BUCKET_BYTES):
            open_by_key.pop(key, None)
        else:
            open_by_key[key] = (b, filled)
    return {names[0] for names in buckets if len(names) == 1}
