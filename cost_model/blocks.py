"""Which repeated block (a ``ModuleList`` entry such as ``blocks.3``) a traced node belongs to.

Read from what ``torch.export`` records: a ``get_attr`` node's target path, or the module stack
(``node.meta["nn_module_stack"]``) of an op. The cost model shares decisions across blocks by it
(``cost_model.problem``), prices their recompute (``cost_model.recompute``), and the lowering
wraps the same blocks in checkpoints (``passes.recompute_regions``)."""

from __future__ import annotations

import re

import torch.fx as fx

__all__ = ["block_of", "attention_segment_of", "split_recompute_entry", "unit_key"]

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


def unit_key(target: str) -> str:
    """The ZeRO unit of the parameter at ``target``, whose weights the runtime gathers and whose
    gradients it reduce-scatters in one collective (``runtime.fsdp``, ``runtime.zero2``): its
    path up to the first numeric part (a repeated block, ``blocks.3.attn.q_proj.weight`` ->
    ``blocks.3``), else its module (``lm_head.weight`` -> ``lm_head``)."""
    parts = target.split(".")
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:k + 1])
    return ".".join(parts[:-1])


# Selective recompute (cost_model/recompute.py, mode "selective") recomputes one segment of each
# block, its attention: the first submodule under the block whose name says so (GPT's ``attn``,
# Hugging Face's ``self_attn``). A plan names it "<prefix>:<segment>" (``blocks:attn``).
_ATTENTION_RE = re.compile(r"(\w+_)?(attn|attention)", re.IGNORECASE)  # attn, self_attn; not post_attention_layernorm


def attention_segment_of(node: fx.Node) -> str | None:
    """The attention submodule (``attn``) of its repeated block that ``node`` runs in, or None."""
    b = block_of(node)
    if b is None or node.op == "get_attr":
        return None
    head = f"{b[0]}.{b[1]}." if b[0] else f"{b[1]}."
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path and path.startswith(head):
            sub = path[len(head):].split(".")[0]
            if _ATTENTION_RE.fullmatch(sub):
                return sub
    return None


def split_recompute_entry(entry: str) -> tuple[str, str | None]:
    """``"blocks:attn"`` -> ("blocks", "attn"); ``"blocks"`` -> ("blocks", None)."""
    prefix, _, segment = entry.partition(":")
    return prefix, segment or None
