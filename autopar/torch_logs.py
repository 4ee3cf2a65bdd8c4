"""Hold torch's own log records back while a torch step that may fail on bad input runs.

When ``torch.export`` fails on a user's model it logs first (an ``E... fake_tensor.py`` traceback,
``W... symbolic_shapes.py`` lines) and prints the partial graph to ``sys.stderr``, and raises
afterwards, so a clear autopar error arrived under dozens of lines. Inside :func:`hold_torch_logs`
every record torch's own handlers would print, and all text written to ``sys.stderr``, is kept
instead: if the step fails, the caller summarises them in its error (:meth:`HeldLogs.summary`);
if it succeeds, they are handed to the handlers (and the stderr) they were meant for, so nothing
is lost. No library offers this: ``torch._logging.set_logs``
changes levels for good and cannot give the records back.

A user who set ``TORCH_LOGS`` asked for torch's logs: then nothing is held.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from typing import Iterator

__all__ = ["HeldLogs", "hold_torch_logs"]


class _Hold(logging.Filter):
    """Keeps each record its handler would emit, and stops the emission."""

    def __init__(self, handler: logging.Handler, held: list[tuple[logging.Handler, logging.LogRecord]]) -> None:
        super().__init__()
        self.handler = handler
        self.held = held

    def filter(self, record: logging.LogRecord) -> bool:
        self.held.append((self.handler, record))
        return False


class HeldLogs:
    """The records held back, in order, each with the handler it was meant for."""

    def __init__(self) -> None:
        self.records: list[tuple[logging.Handler, logging.LogRecord]] = []
        self.stderr = io.StringIO()

    def summary(self) -> str:
        """`` (torch also logged 1 error, 14 printed lines, held back, the first: '...'; set TORCH_LOGS=...)``,
        or ``""`` when nothing at warning level or above was held."""
        unique = {id(r): r for _, r in self.records}  # a record meant for two handlers counts once
        loud = [r for r in unique.values() if r.levelno >= logging.WARNING]
        printed = len([line for line in self.stderr.getvalue().splitlines() if line.strip()])
        parts = [f"{n} {word}{'s' if n != 1 else ''}" for n, word in (
            (sum(1 for r in loud if r.levelno >= logging.ERROR), "error"),
            (sum(1 for r in loud if r.levelno < logging.ERROR), "warning"),
            (printed, "printed line")) if n]
        if not parts:
            return ""
        first = loud[0].getMessage().strip().splitlines() if loud else []
        quote = f", the first: {first[0][:120]!r}" if first else ""
        return f" (torch also logged {', '.join(parts)}, held back{quote}; set TORCH_LOGS=export to see them)"

    def release(self) -> None:
        """Emit the held records through the handlers they were meant for."""
        records, self.records = self.records, []
        for handler, record in records:
            handler.handle(record)
        text, self.stderr = self.stderr.getvalue(), io.StringIO()
        if text:
            sys.stderr.write(text)


def _torch_handlers() -> list[logging.Handler]:
    """The console handlers on torch's loggers (torch installs its own and stops propagation).
    File and structured-trace handlers (TORCH_LOGS_OUT, TORCH_TRACE) were asked for: left alone."""
    loggers = [logging.getLogger("torch")] + [
        lg for name, lg in list(logging.Logger.manager.loggerDict.items())
        if name.startswith("torch.") and isinstance(lg, logging.Logger)]
    seen: dict[int, logging.Handler] = {}
    for lg in loggers:
        for handler in lg.handlers:
            if type(handler) is logging.StreamHandler:
                seen.setdefault(id(handler), handler)
    return list(seen.values())


@contextlib.contextmanager
def hold_torch_logs() -> Iterator[HeldLogs]:
    """Hold torch's log records and what is printed to ``sys.stderr`` for the duration (see module doc). The caller decides: on
    success call :meth:`HeldLogs.release`, on failure put :meth:`HeldLogs.summary` in its error."""
    held = HeldLogs()
    if os.environ.get("TORCH_LOGS"):
        yield held
        return
    # The handlers are torch's (process-wide); the filters are removed on the way out, whatever happens.
    filters = [(h, _Hold(h, held.records)) for h in _torch_handlers()]
    for handler, f in filters:
        handler.addFilter(f)
    try:
        with contextlib.redirect_stderr(held.stderr):
            yield held
    finally:
        for handler, f in filters:
            handler.removeFilter(f)
