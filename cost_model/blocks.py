"""Which repeated block (a ``ModuleList`` entry such as ``blocks.3``) a traced node belongs to.

Read from what ``torch.export`` records: a ``get_attr`` node's target path, or the module stack
(``node.meta["nn_module_stack"]``) of an op. The cost model shares decisions across blocks by it
(``cost_model.problem``), prices their recompute (``cost_model.recompute``), and the lowering
wraps the same blocks in checkpoints (``passes.recompute_regions``)."""

from __future__ import annotations

import re

import torch.fx as fx

__all__ = ["block_of"]

_BLOCK_RE = re.compile(r"^(?P<prefix>.*?)\.?(?P<index>\d+)$")


def block_of(node: fx.Node) -> tuple[str, int] | None:
    """(container path, index) of the repeated block a node belongs to, or None."""
    if node.op == "get_attr":
        parts = str(node.target).split(".")
        for k, part in enumerate(parts[:-1]):
            if part.isdigit():
                return ".".join(parts[:k]), int(part)
        return None
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in stack.values():
        m = _BLOCK_RE.match(path or "")
        if m and m.group("prefix"):
            return m.group("prefix"), int(m.group("index"))
    return None
