"""The rule registry: one sharding rule per ATen op, a dict plus a decorator.

A rule is a function called with the op's arguments, tensors given as values that carry
``shape`` and ``dtype`` (FakeTensors while planning, real tensors while validating), and
returning an :class:`~autopar.passes.rules.spec.OpSpec` that describes the op for one mesh
axis. Every rule also names ``samples``: small real inputs on which the ground-truth
validation (``autopar.passes.validate``) checks each strategy the rule produces against the
unsharded op. A rule that cannot be validated does not ship.

An op of another library that exists only once that library is imported (Hugging Face's
``transformers::grouped_mm_fallback``) is registered by its qualified name, a string; the
rule attaches to the op the first time a graph holding it is annotated, and
:func:`registered_ops` lists it once the op is loaded. autopar never imports the library.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, TypeAlias

from .spec import OpSpec

__all__ = ["Rule", "RuleFn", "SampleFn", "RuleError", "register_rule", "get_rule", "has_rule",
           "registered_ops", "temporary_rule", "op_name"]

RuleFn: TypeAlias = Callable[..., OpSpec]
# A sample is (args, kwargs) of real tensors whose sharded dims divide by 8 (a 2x2x2 mesh).
SampleFn: TypeAlias = Callable[[], Sequence[tuple[tuple[Any, ...], dict[str, Any]]]]


class RuleError(KeyError):
    """A rule that is missing, or registered twice."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class Rule:
    op: Any  # a torch._ops.OpOverload
    fn: RuleFn
    samples: SampleFn

    @property
    def name(self) -> str:
        return op_name(self.op)


_RULES: dict[Any, Rule] = {}
# Rules of ops named "namespace::name" (their default overload), not loaded yet.
_BY_NAME: dict[str, tuple[RuleFn, SampleFn]] = {}


def _loaded(name: str) -> Any | None:
    """The default overload of the custom op ``name`` if its library has loaded it, else None."""
    import torch

    namespace, _, op = name.partition("::")
    try:
        return getattr(getattr(torch.ops, namespace), op).default
    except (AttributeError, RuntimeError):
        return None


def _by_name(op: Any) -> Rule | None:
    schema = getattr(op, "_schema", None)
    if schema is None or getattr(op, "_overloadname", None) != "default" or schema.name not in _BY_NAME:
        return None
    fn, samples = _BY_NAME[schema.name]
    _RULES[op] = rule = Rule(op, fn, samples)
    return rule


def op_name(op: Any) -> str:
    """``aten.mm.default`` for an OpOverload, the qualified name for anything else."""
    return str(op) if hasattr(op, "_schema") else getattr(op, "__qualname__", repr(op))


def register_rule(*ops: Any, samples: SampleFn) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the sharding rule of each of ``ops``; a second rule for one op raises."""

    def decorator(fn: RuleFn) -> RuleFn:
        for op in ops:
            if isinstance(op, str):
                if op in _BY_NAME or _loaded(op) in _RULES:
                    raise RuleError(f"a sharding rule for {op} is already registered")
                _BY_NAME[op] = (fn, samples)
                continue
            if op in _RULES:
                raise RuleError(
                    f"a sharding rule for {op_name(op)} is already registered "
                    f"({_RULES[op].fn.__module__}.{_RULES[op].fn.__qualname__}); "
                    f"use autopar.passes.rules.temporary_rule to override it in a test"
                )
            _RULES[op] = Rule(op, fn, samples)
        return fn

    return decorator


def get_rule(op: Any) -> Rule:
    try:
        return _RULES[op]
    except KeyError:
        rule = _by_name(op)
        if rule is not None:
            return rule
        raise RuleError(
            f"no sharding rule for {op_name(op)}; register one with "
            f"@autopar.passes.rules.register_rule({op_name(op)}, samples=...)"
        ) from None


def has_rule(op: Any) -> bool:
    return op in _RULES or _by_name(op) is not None


def registered_ops() -> list[Any]:
    """Every op with a rule; an op registered by name is listed once its library loaded it."""
    for name in _BY_NAME:
        op = _loaded(name)
        if op is not None and op not in _RULES:
            _by_name(op)
    return list(_RULES)


@contextlib.contextmanager
def temporary_rule(op: Any, fn: RuleFn, samples: SampleFn = lambda: ()) -> Iterator[Rule]:
    """Register (or override) the rule of ``op`` inside a ``with`` block, restoring it after."""
    previous = _RULES.get(op)
    _RULES[op] = rule = Rule(op, fn, samples)
    try:
        yield rule
    finally:
        if previous is None:
            del _RULES[op]
        else:
            _RULES[op] = previous
