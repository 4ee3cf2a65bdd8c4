"""An independent count of what reaches torch.distributed, for checking autopar's byte counter.

autopar's runtime counts its own traffic (``autopar.runtime.count_bytes``) with the cost
model's formulas. This spy shares no code with either: it wraps the ``torch.distributed``
functions themselves for the duration of a ``with`` block, records every call's payload and
group size, and converts calls to bytes one rank sends with ring formulas written out here
(nccl-tests' bus-bandwidth factors): all-reduce 2(n-1)/n of the buffer, all-gather (n-1)/n of
the gathered output, reduce-scatter (n-1)/n of the input, all-to-all (n-1)/n of the input,
broadcast and reduce the whole buffer (pipelined ring), a point-to-point send its tensor.
An ``all_to_all_single`` with ``input_split_sizes`` sends exactly the rows bound for the other
ranks (uneven splits: expert parallelism), counted row by row.
It does not import autopar.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def _size(group) -> int:
    return dist.get_world_size(group)


class ByteSpy:
    """``with ByteSpy() as spy: ...`` then ``spy.sent``: bytes this rank sent, per kind."""

    # function name -> (kind, the argument whose tensor bytes the formula reads)
    WRAPPED = {
        "all_reduce": ("all_reduce", "tensor"),
        "all_gather": ("all_gather", "tensor_list"),                 # the gathered output
        "all_gather_into_tensor": ("all_gather", "output_tensor"),
        "reduce_scatter": ("reduce_scatter", "input_list"),          # the whole input
        "reduce_scatter_tensor": ("reduce_scatter", "input"),
        "all_gather_single": ("all_gather", "output_tensor"),        # torch 2.13's new names
        "reduce_scatter_single": ("reduce_scatter", "input"),
        "all_to_all_single": ("all_to_all", "input"),
        "broadcast": ("broadcast", "tensor"),
        "reduce": ("reduce", "tensor"),
        "isend": ("p2p", "tensor"),
        "send": ("p2p", "tensor"),
    }
    # torch.distributed re-exports these from distributed_c10d, whose own code (P2POp's check,
    # batch_isend_irecv) compares against the module's names: patch both namespaces.
    MODULES = (dist, c10d)

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []  # (kind, payload bytes, group size)
        self._saved: dict = {}

    def _wrap(self, name: str, fn):
        kind, payload = self.WRAPPED[name]
        signature = inspect.signature(fn)

        def spy(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            splits = bound.get("input_split_sizes") if name == "all_to_all_single" else None
            if splits:
                t = bound[payload]
                row_bytes = t[0].numel() * t.element_size() if t.shape[0] else 0
                mine = splits[dist.get_rank(bound.get("group"))]
                self.calls.append(("all_to_all_rows", (sum(splits) - mine) * row_bytes, _size(bound.get("group"))))
            else:
                self.calls.append((kind, _nbytes(bound[payload]), _size(bound.get("group"))))
            return fn(*args, **kwargs)

        return spy

    def __enter__(self) -> "ByteSpy":
        for name in self.WRAPPED:
            original = getattr(c10d, name, None)
            if original is None:  # a name this torch does not have
                continue
            self._saved[name] = original
            wrapper = self._wrap(name, original)
            for module in self.MODULES:
                setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            for module in self.MODULES:
                setattr(module, name, fn)

    @property
    def sent(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for kind, nbytes, n in self.calls:
            if n == 1 or nbytes == 0:
                continue
            if kind == "all_reduce":
                out[kind] += 2 * (n - 1) / n * nbytes
            elif kind in ("all_gather", "reduce_scatter", "all_to_all"):
                out[kind] += (n - 1) / n * nbytes
            elif kind == "all_to_all_rows":  # already only the rows that leave this rank
                out["all_to_all"] += nbytes
            else:
                out[kind] += nbytes
        return dict(out)


@contextlib.contextmanager
def spy_bytes():
    with ByteSpy() as spy:
        yield spy
