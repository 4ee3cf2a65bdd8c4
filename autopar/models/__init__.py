"""Model zoo: named models that build as `(model, example_inputs)`.

`model(*example_inputs)` returns the scalar training loss, so a traced graph
ends at the loss. Every factory accepts `device="meta"` and then allocates no
parameter or input storage, which is how the large entries are analysed.

    model, inputs = get_model("gpt2", batch_size=4, seq_len=512, device="meta")
"""

from __future__ import annotations

import dataclasses

import difflib
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import Tensor, nn

from ..errors import AutoparError
from .bert import BERT_CONFIGS, Bert, BertConfig, bert
from .gpt import GPT, GPT_CONFIGS, GPTConfig, gpt
from .hf import HF_BERT_TINY, HF_GPT2_TINY, HFLossWrapper, hf_bert, hf_gpt2
from .mlp import MLP, MLPConfig, mlp
from .vit import VIT_CONFIGS, ViT, ViTConfig, vit

__all__ = [
    "ModelEntry",
    "ZOO",
    "UnknownModelError",
    "get_model",
    "list_models",
    "MLP",
    "MLPConfig",
    "mlp",
    "GPT",
    "GPTConfig",
    "GPT_CONFIGS",
    "gpt",
    "Bert",
    "BertConfig",
    "BERT_CONFIGS",
    "bert",
    "ViT",
    "ViTConfig",
    "VIT_CONFIGS",
    "vit",
    "HFLossWrapper",
    "hf_gpt2",
    "hf_bert",
]

Factory = Callable[..., tuple[nn.Module, tuple[Tensor, ...]]]


@dataclass(frozen=True)
class ModelEntry:
    """A zoo model: `factory(batch_size=, seq_len=, device=, dtype=)` builds it.

    `seq_len` is None for models without a free sequence dimension (the MLP).
    """

    name: str
    factory: Factory
    description: str
    batch_size: int
    seq_len: int | None
    gpus: int = 8  # the device count the entry is meant to be planned at (`autopar zoo` lists it)

    def build(
        self,
        batch_size: int | None = None,
        seq_len: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> tuple[nn.Module, tuple[Tensor, ...]]:
        """Build with this entry's defaults for any shape argument left as None."""
        return self.factory(
            batch_size=self.batch_size if batch_size is None else batch_size,
            seq_len=self.seq_len if seq_len is None else seq_len,
            device=device,
            dtype=dtype,
        )


class UnknownModelError(AutoparError, KeyError, ValueError):
    """Raised for a name not in ZOO; catchable as AutoparError, KeyError or ValueError."""

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message, quoting it.
        return str(self.args[0]) if self.args else ""


def _entries() -> dict[str, ModelEntry]:
    """Every zoo entry; default shapes are typical training micro-batches."""
    e: list[ModelEntry] = [
        ModelEntry("mlp", mlp, "3-hidden-layer GELU MLP classifier, 64->256->10", 32, None),
    ]
    gpt_shapes = {"gpt-tiny": (2, 32), "gpt3-6.7b": (1, 2048), "gpt3-13b": (1, 2048), "gpt3-175b": (1, 2048)}
    for name, c in GPT_CONFIGS.items():
        b, t = gpt_shapes.get(name, (8, c.block_size))
        desc = f"GPT, {c.n_layer} layers, {c.n_head} heads, d={c.n_embd}, vocab {c.vocab_size}, untied head"
        e.append(ModelEntry(name, partial(gpt, name), desc, b, t))
    for name, c in BERT_CONFIGS.items():
        b, t = (2, 32) if name == "bert-tiny" else (8, c.max_position)
        desc = f"BERT MLM, {c.n_layer} layers, {c.n_head} heads, d={c.hidden}, vocab {c.vocab_size}"
        e.append(ModelEntry(name, partial(bert, name), desc, b, t))
    for name, c in VIT_CONFIGS.items():
        b = 2 if name == "vit-tiny" else 8
        desc = (
            f"ViT classifier, {c.image_size}px/{c.patch_size}px patches, {c.n_layer} layers, "
            f"{c.n_head} heads, d={c.hidden}, {c.num_classes} classes"
        )
        e.append(ModelEntry(name, partial(vit, name), desc, b, c.seq_len))
    e += [
        ModelEntry("hf-gpt2-tiny", partial(hf_gpt2, **HF_GPT2_TINY),
                   "HF GPT2LMHeadModel, 2 layers, d=64, vocab 128 (tied head)", 2, 32),
        ModelEntry("hf-gpt2", hf_gpt2, "HF GPT2LMHeadModel, GPT-2 small config (tied head)", 8, 1024),
        ModelEntry("hf-bert-tiny", partial(hf_bert, **HF_BERT_TINY),
                   "HF BertForMaskedLM, 2 layers, d=64, vocab 128", 2, 32),
    ]
    return {entry.name: entry for entry in e}


# Models whose state (weights, gradients, AdamW) needs more than one node of 8 x 80 GB, or too
# small to spread over more than a few devices: planned at this device count by default.
_GPUS = {"mlp": 4, "gpt-tiny": 4, "bert-tiny": 4, "vit-tiny": 4, "hf-gpt2-tiny": 4, "hf-bert-tiny": 4,
         "gpt2-xl": 64, "gpt3-6.7b": 64, "gpt3-13b": 128, "gpt3-175b": 1024}
ZOO: dict[str, ModelEntry] = {name: dataclasses.replace(e, gpus=_GPUS.get(name, e.gpus))
                              for name, e in _entries().items()}


def list_models() -> list[ModelEntry]:
    """All zoo entries, in registration order."""
    return list(ZOO.values())


def get_model(
    name: str,
    batch_size: int | None = None,
    seq_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[nn.Module, tuple[Tensor, ...]]:
    """Build zoo model `name`; returns `(model, example_inputs)`.

    Raises UnknownModelError (a KeyError and a ValueError) naming the closest
    match and all known names if `name` is not in ZOO.
    """
    entry = ZOO.get(name)
    if entry is None:
        close = difflib.get_close_matches(name, ZOO.keys(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownModelError(
            f"Unknown model {name!r}.{hint} Known models: {', '.join(ZOO)} (`autopar zoo` describes them), "
            "or pass your own factory as package.module:function"
        )
    return entry.build(batch_size=batch_size, seq_len=seq_len, device=device, dtype=dtype)
