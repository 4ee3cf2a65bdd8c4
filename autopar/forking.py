"""Share independent pieces of the planner's work with one forked child process.

The planner's searches are many independent pricings (a mesh's LP bound, a pipeline sub-mesh's
three stage pieces) over one traced graph. On a machine with a second core, a forked child
computes part of them: it inherits the graph instead of pickling it (fx nodes do not pickle
cheaply), and sends back only its results, pickled through a pipe. Where fork is not safe or not
available, or the child fails, this process computes everything itself: same inputs, same
answers, so forking changes the wall time only.

Written by hand, not with ``concurrent.futures``: a process pool pickles the function and its
arguments (a closure over the graph does not pickle) and starts a management thread in the
parent, after which a later fork is no longer safe (``fork_is_safe``).
"""

from __future__ import annotations

import os
import pickle
from typing import Callable, Sequence, TypeVar

__all__ = ["fork_is_safe", "share_work"]

T = TypeVar("T")
R = TypeVar("R")


def _threads() -> int:
    """This process's threads, native ones included (Linux: /proc); 0 where that cannot be read."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def fork_is_safe() -> bool:
    """Fork only a single-threaded process, the one case where POSIX fork is safe: a thread of
    the parent (torch.distributed's communication threads when parallelize plans on rank 0,
    pytest-xdist's execnet threads) may hold a lock, e.g. the allocator's, that the child then
    inherits held; the child then crashed in garbage collection."""
    return hasattr(os, "fork") and _threads() == 1 and (os.cpu_count() or 1) > 1


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _child(items: Sequence[T], work: Callable[[T], R], write_fd: int) -> None:
    """In the forked child: compute, send the pickled results, exit without running the
    parent's exit handlers or flushing its copied stdio buffers."""
    code = 1
    try:
        data = pickle.dumps([work(x) for x in items], protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(data)
        while view:
            view = view[os.write(write_fd, view):]
        code = 0
    except BaseException:  # noqa: BLE001 (the parent recomputes this share; nothing to report here)
        code = 1
    finally:
        os._exit(code)


def share_work(items: Sequence[T], work: Callable[[T], R], weight: Callable[[T], float] = lambda _: 1.0,
               fork: bool | None = None) -> list[R]:
    """``[work(x) for x in items]``, part of it computed in a forked child (module doc).

    ``weight`` estimates an item's cost; the child takes the heaviest items in turn while its
    share is the lighter one. ``work`` must not depend on the order the items are computed in,
    and its results must pickle. ``fork=None`` forks where ``fork_is_safe()``."""
    items = list(items)
    if fork is None:
        fork = fork_is_safe()
    if not fork or len(items) < 2:
        return [work(x) for x in items]
    order = sorted(range(len(items)), key=lambda i: -weight(items[i]))
    mine, theirs, remote = 0.0, 0.0, []
    for i in order:
        if theirs < mine:
            theirs += weight(items[i])
            remote.append(i)
        else:
            mine += weight(items[i])
    remote.sort()
    try:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
    except OSError:
        return [work(x) for x in items]
    if pid == 0:  # the child
        os.close(read_fd)
        _child([items[i] for i in remote], work, write_fd)
    os.close(write_fd)
    results: dict[int, R] = {}
    try:
        for i in range(len(items)):
            if i not in remote:
                results[i] = work(items[i])
        data = _read_all(read_fd)
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    theirs_results = None
    if os.waitstatus_to_exitcode(status) == 0:
        try:
            theirs_results = pickle.loads(data)
        except Exception:  # noqa: BLE001 (a torn pipe: recompute the share here)
            theirs_results = None
    if theirs_results is None or len(theirs_results) != len(remote):
        theirs_results = [work(items[i]) for i in remote]
    results.update(zip(remote, theirs_results))
    return [results[i] for i in range(len(items))]
