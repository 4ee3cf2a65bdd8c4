"""Share independent pieces of the planner's work with one forked child process.

The planner's searches are many independent pricings (a mesh's LP bound, a pipeline sub-mesh's
three stage pieces) over one traced graph. On a machine with a second core, a forked child
computes part of them: it inherits the graph instead of pickling it (fx nodes do not pickle
cheaply), and sends back only its results, pickled through a pipe. Where fork is not safe or not
available, or the child fails, this process computes everything itself: same inputs, same
answers, so forking changes the wall time only.

The child takes work as it goes (``share_work``): the items' indices wait in a pipe, heaviest
first, and each process reads the next one when it is free (a read of a few bytes from a pipe is
atomic), so a share whose items turn out cheaper than their weight said (a pipeline sub-mesh
pruned after one piece) leaves no core idle. ``SharedQueues`` does the same over several queues
in turn, the child sending each queue's results as soon as it is empty.

Written by hand, not with ``concurrent.futures``: a process pool pickles the function and its
arguments (a closure over the graph does not pickle) and starts a management thread in the
parent, after which a later fork is no longer safe (``fork_is_safe``): the planner's first pool
left the pipeline search it ran next unforked.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
from typing import Callable, Generic, Sequence, TypeVar

__all__ = ["fork_is_safe", "share_work", "SharedQueues"]

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


_INDEX = struct.Struct("<I")


def _claims(fd: int):
    """Indices read one at a time from the shared queue until it is empty."""
    while True:
        got = os.read(fd, _INDEX.size)
        if len(got) < _INDEX.size:
            return
        yield _INDEX.unpack(got)[0]


def share_work(items: Sequence[T], work: Callable[[T], R], weight: Callable[[T], float] = lambda _: 1.0,
               fork: bool | None = None) -> list[R]:
    """``[work(x) for x in items]``, part of it computed in a forked child (module doc): one
    ``SharedQueues`` queue, the items handed out heaviest first (``weight`` estimates an item's
    cost), each to the process that is free. ``work`` must not depend on the order the items
    are computed in, and its results must pickle. ``fork=None`` forks where ``fork_is_safe()``."""
    items = list(items)
    if not (fork_is_safe() if fork is None else fork) or len(items) < 2:
        return [work(x) for x in items]
    shared = SharedQueues([items], lambda q, x: work(x), lambda q, x: weight(x), fork=True)
    mine = {i: work(x) for i, x in shared.take(0)}
    got = {**shared.theirs(0), **mine}
    return [got[i] for i in range(len(items))]


class SharedQueues(Generic[T, R]):
    """Queues of items shared with a forked child, taken in order: each process takes the next
    item of the current queue when it is free, and the child sends its results of a queue as
    soon as that queue is empty, then goes on to the next. This process takes its items with
    ``take(q)`` (a generator: it computes them as it likes, between other work) and then
    ``theirs(q)`` waits for the child's results of queue q: what the child took of it, as
    ``{index: result}``; where the child failed, what neither process computed is computed here.

    The planner's helper: queue 0 the meshes to bound, queue 1 the baseline families; this
    process solves its ILPs between the two while the child goes on with the baselines."""

    def __init__(self, queues: Sequence[Sequence[T]], work: Callable[[int, T], R],
                 weight: Callable[[int, T], float] = lambda q, x: 1.0, fork: bool | None = None):
        self.queues, self.work = [list(q) for q in queues], work
        self._taken: list[set[int]] = [set() for _ in self.queues]
        self._fds: list[int] = []
        self._queue_fds: list[int] = []
        self._pid = None
        self._local = [iter(()) for _ in self.queues]  # after the child: nothing more to take here
        if (fork_is_safe() if fork is None else fork) and sum(map(len, self.queues)) * _INDEX.size <= 4096:
            try:
                self._start(weight)
            except OSError:
                self._pid = None
        if self._pid is None:  # everything here: the queues hold every index, in order
            self._fds = []
            self._local = [iter(range(len(q))) for q in self.queues]

    def _start(self, weight) -> None:
        queue_fds, result_fds = [], []
        for k, q in enumerate(self.queues):
            r, w = os.pipe()
            os.write(w, b"".join(_INDEX.pack(i) for i in sorted(range(len(q)), key=lambda i: -weight(k, q[i]))))
            os.close(w)
            queue_fds.append(r)
            result_fds.append(os.pipe())
        pid = os.fork()
        if pid == 0:  # the child: each queue in turn, its results sent when the queue is empty
            code = 1
            try:
                for k, q in enumerate(self.queues):
                    got = [(i, self.work(k, q[i])) for i in _claims(queue_fds[k])]
                    view = memoryview(pickle.dumps(got, protocol=pickle.HIGHEST_PROTOCOL))
                    while view:
                        view = view[os.write(result_fds[k][1], view):]
                    os.close(result_fds[k][1])
                code = 0
            except BaseException:  # noqa: BLE001 (the parent computes what is missing)
                code = 1
            finally:
                os._exit(code)
        for _, w in result_fds:
            os.close(w)
        self._pid, self._queue_fds = pid, queue_fds
        self._fds = [r for r, _ in result_fds]

    def take(self, q: int):
        """This process's items of queue q, as (index, item), each taken when asked for."""
        source = _claims(self._queue_fds[q]) if self._pid is not None else self._local[q]
        for i in source:
            self._taken[q].add(i)
            yield i, self.queues[q][i]

    def theirs(self, q: int) -> dict[int, R]:
        """The child's results of queue q (after ``take(q)`` is exhausted); computed here where
        the child failed."""
        left = {i: self.work(q, x) for i, x in self.take(q)}  # whatever this process left untaken
        got: dict[int, R] = {}
        if self._pid is not None:
            try:
                got = dict(pickle.loads(_read_all(self._fds[q])))
            except Exception:  # noqa: BLE001 (a failed child: computed below)
                got = {}
            finally:
                os.close(self._fds[q])
                os.close(self._queue_fds[q])
                self._fds[q] = self._queue_fds[q] = -1
            if not any(self.queues[q + 1:]):  # the child has nothing more to do
                self.close()
        missing = set(range(len(self.queues[q]))) - self._taken[q] - set(got)
        return {**got, **left, **{i: self.work(q, self.queues[q][i]) for i in sorted(missing)}}

    def close(self) -> None:
        """Stop the child (a search that failed need not wait for it) and reap it."""
        if self._pid is not None:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except OSError:
                pass
            os.waitpid(self._pid, 0)
            self._pid = None
            for fd in self._fds + self._queue_fds:
                if fd >= 0:
                    os.close(fd)
            self._fds = self._queue_fds = []
