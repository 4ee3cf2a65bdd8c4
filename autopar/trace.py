"""trace: an unmodified nn.Module and example inputs -> a torch.fx GraphModule.

Uses ``torch.export.export(..., strict=False)`` (it traces Hugging Face models that
``torch.fx.symbolic_trace`` cannot) and returns the unlifted module, so parameters and
buffers are ``get_attr`` nodes named by their module path and the graph is callable with the
user's own inputs. Every tensor node carries ``node.meta["val"]``, a FakeTensor with shape and
dtype. Models built on the ``meta`` device trace without allocating memory.

When export fails the error names the source line of the model that failed and the likely
fix, with export's own message below it, in three lines; torch's own log records from the failed
export are held back and counted in the message (``autopar.torch_logs``), and the example inputs
are checked against ``forward``'s signature before export runs.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import traceback
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from .errors import TraceError
from .passes.regions import collapse_regions
from .torch_logs import hold_torch_logs
from .trace_repeat import trace_repeated

__all__ = ["trace", "TraceError", "graph_fingerprint"]

# Nodes export adds to guard the traced assumptions; they compute nothing the plan needs.
_GUARD_TARGETS = {torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default,
                  torch.ops.aten.sym_constrain_range_for_size.default}

_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = os.path.dirname(inspect.__file__)


def trace(model: nn.Module, example_inputs: Sequence[Any], example_kwargs: dict[str, Any] | None = None,
          *, stack_traces: bool = True, repeat_blocks: bool = False) -> fx.GraphModule:
    """Trace ``model(*example_inputs, **example_kwargs)`` into a GraphModule (see module doc).

    ``stack_traces=False`` skips recording each node's source stack (``node.meta["stack_trace"]``),
    about a tenth of the trace time; the planner, which never shows them, passes False.
    ``repeat_blocks=True``: a model with a list of alike blocks is traced with three of them and
    its graph rebuilt at full depth (``autopar.trace_repeat``; the same graph, in a fraction of
    the time for deep models); the planner passes True."""
    if not isinstance(model, nn.Module):
        raise TraceError(f"autopar.trace expects an nn.Module, got {type(model).__name__}; pass the model "
                         "object (e.g. model, inputs = autopar.models.get_model('gpt2'))")
    if example_inputs is None:
        example_inputs = ()
    args = tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    _check_arguments(model, args, kwargs)
    gm = trace_repeated(model, lambda m: _exported(m, args, kwargs, stack_traces)) if repeat_blocks else None
    if gm is None:
        gm = _exported(model, args, kwargs, stack_traces)
    return collapse_regions(gm)  # regions of registered region techniques become one node each


def _exported(model: nn.Module, args: tuple, kwargs: dict, stack_traces: bool) -> fx.GraphModule:
    """torch.export's unlifted module of the call, its guard nodes dropped."""
    saved = fx.config.do_not_emit_stack_traces
    fx.config.do_not_emit_stack_traces = saved or not stack_traces
    try:
        with hold_torch_logs() as held:
            try:
                exported = torch.export.export(model, args, kwargs, strict=False)
            except Exception as exc:  # re-raised with the model's failing line and a fix
                raise TraceError(_explain(exc, model, args) + held.summary()) from exc
        held.release()  # export succeeded: its warnings are the user's to see
    finally:
        fx.config.do_not_emit_stack_traces = saved
    try:  # no guard function to build (a tenth of the trace time on deep models): the caller drops it anyway
        gm = exported.module(check_guards=False)
    except TypeError:  # a torch without the option
        gm = exported.module()
    _drop_guards(gm)
    return gm


def _check_arguments(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """The example inputs must bind to ``forward``'s parameters; export's own error for a
    missing input points into ``inspect``, not at the call."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward without a readable signature: export will tell
        return
    sig = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
                      return_annotation=inspect.Signature.empty)
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise TraceError(
            f"cannot trace {type(model).__name__}: the example inputs do not fit forward{sig} "
            f"({len(args)} positional, {len(kwargs)} keyword: {_describe(args)}): {exc}; pass example_inputs "
            "with one value per argument of forward(), e.g. the inputs autopar.models.get_model returns") from exc


def _describe(args: tuple) -> str:
    """``float32[4,8], int64[4]``: the example inputs as an error shows them."""
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{str(v.dtype).replace('torch.', '')}[{','.join(str(s) for s in v.shape)}]"
        if isinstance(v, (list, tuple)):
            return "(" + ", ".join(one(x) for x in v) + ")"
        return type(v).__name__
    return ", ".join(one(a) for a in args) or "none"


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """A short digest of the graph's nodes (name, op, target, shape, dtype), in order: two traces
    of the same model with inputs of the same shapes agree; another model, another size or
    another batch shape does not."""
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        shape = (tuple(val.shape), str(val.dtype)) if isinstance(val, torch.Tensor) else None
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        h.update(f"{node.name}|{node.op}|{target}|{shape}\n".encode())
    return h.hexdigest()[:16]


def _drop_guards(gm: fx.GraphModule) -> None:
    graph = gm.graph
    dropped = False
    for node in list(graph.nodes):
        is_guard_module = node.op == "call_module" and node.target == "_guards_fn"
        if (is_guard_module or (node.op == "call_function" and node.target in _GUARD_TARGETS)) and not node.users:
            graph.erase_node(node)
            dropped = True
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    if dropped:
        graph.lint()
        gm.recompile()


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the failing call that is outside torch: the model's own line."""
    frames = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        frames.extend(traceback.extract_tb(e.__traceback__))
        e = e.__cause__ or e.__context__
    user = [f for f in frames if not f.filename.startswith((_TORCH_DIR, _STDLIB_DIR, "<"))
            and "/autopar/" not in f.filename and "site-packages/torch" not in f.filename]
    return user[-1] if user else None


def _frame_from_message(message: str) -> str | None:
    """export often prints the user's stack in its message; take its last model line."""
    lines = re.findall(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.+)', message)
    lines = [l for l in lines if not l[0].startswith(_TORCH_DIR) and "site-packages/torch" not in l[0]]
    if not lines:
        return None
    path, line, fn, src = lines[-1]
    return f"{path}:{line} in {fn}: {src.strip()}"


def _is_missing_fake(exc: BaseException) -> bool:
    """A custom op without a fake (meta) kernel: export cannot know its output's shape."""
    e: BaseException | None = exc
    while e is not None:
        message = str(e).lower()
        if type(e).__name__ in ("UnsupportedOperatorException", "DynamicOutputShapeException") or (
                "fake" in message and ("impl" in message or "kernel" in message)):
            return True
        e = e.__cause__
    return False


def _explain(exc: Exception, model: nn.Module, args: tuple) -> str:
    """Three lines: the problem and where, the fix, and export's own first line."""
    message = str(exc)
    where = _frame_from_message(message)
    if where is None:
        frame = _user_frame(exc)
        if frame is not None:
            where = f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    name = type(model).__name__
    lowered = message.lower()
    if "data-dependent" in lowered or "guardondatadependent" in type(exc).__name__.lower() or "could not guard" in lowered:
        problem = "Python control flow depends on tensor values (e.g. `if x.sum() > 0:`)"
        fix = ("make the branch static, or express it with tensor ops: torch.where(cond, a, b) "
               "for values, torch.cond for branches")
    elif _is_missing_fake(exc):
        op = re.search(r"(\w+(?:::|\.)\w+)", message)
        opname = op.group(1).replace(".", "::", 1) if op else "a custom op"
        problem = f"{opname} has no fake (meta) implementation, so its output shape is unknown"
        fix = (f"register one with @torch.library.register_fake(\"{opname}\") returning an empty tensor of "
               "the output's shape and dtype")
    elif "unsupported" in lowered or "not supported" in lowered:
        problem = "the model uses a construct torch.export does not support"
        fix = "rewrite that line with plain tensor ops, or move it out of forward()"
    else:
        problem = f"forward() failed on the example inputs {_describe(args)} ({type(exc).__name__})"
        fix = ("pass example inputs of the shapes and dtypes forward() expects (the model runs on them "
               "eagerly), and use only tensor operations in forward()")
    first = message.strip().splitlines()[0] if message.strip() else type(exc).__name__
    at = f" at {where}" if where else ""
    return (f"cannot trace {name}: {problem}{at}.\n  fix: {fix}.\n"
            f"  torch.export said: {first[:300]}")
