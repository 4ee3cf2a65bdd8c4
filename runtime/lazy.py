"""The one-line API: ``model = autopar.parallelize(model)`` before the usual training loop.

No example inputs are needed: the first call traces the model with the batch it is given,
plans (rank 0; every rank runs the same plan) and builds this rank's program. The Parameter
objects of the user's model - the ones an optimizer built before the first step already holds -
become this rank's shards in place, so ``opt = AdamW(model.parameters())`` may come before or
after ``parallelize`` and the loop is unchanged. Outputs are what the model returns (a Hugging
Face ``ModelOutput`` with ``.loss`` and ``.logits`` included).

One plan per module: a later call whose inputs differ in structure, shape or dtype raises
:class:`InputSignatureError` (the shards and optimizer state follow the first plan, and another
batch shape may want another layout); keep the batch shape fixed (drop or pad the last batch),
or parallelize a second model explicitly with ``example_inputs``. The lazy module does not
pipeline (a pipelined plan is driven by ``step(*batch)``; ask for one with ``example_inputs`` and
pipeline options, and call ``pm.step``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from autopar.errors import AutoparError

__all__ = ["LazyParallelModule", "InputSignatureError", "input_signature"]

_PIPELINE_OPTIONS = ("n_microbatches", "schedule", "pipeline")


class InputSignatureError(AutoparError, ValueError):
    """A call whose inputs differ from those the lazy module planned with."""


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """What a plan depends on in a call's inputs: their structure, and each tensor's shape and dtype."""
    leaves, spec = tree_flatten((args, kwargs))
    return (str(spec),) + tuple((tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else repr(x)
                                for x in leaves)


def _describe(signature: tuple) -> str:
    return ", ".join(f"{list(s[0])} {s[1].replace('torch.', '')}" if isinstance(s, tuple) else str(s)
                     for s in signature[1:])


class LazyParallelModule(nn.Module):
    """What ``autopar.parallelize(model)`` returns without example inputs (see module doc).
    Before its first call its parameters are the model's own (whole); after it, the same
    Parameter objects hold this rank's shards. Attributes of the built ``ParallelModule``
    (``plan``, ``shards()``, ``full_state_dict()``, ...) are reachable once it has run."""

    def __init__(self, model: nn.Module, n_gpus: int | None, options: dict[str, Any], build: Callable[..., nn.Module]) -> None:
        super().__init__()
        asked = [k for k in _PIPELINE_OPTIONS if options.get(k)]
        if asked:
            raise AutoparError(f"the lazy parallelize(model) does not pipeline ({', '.join(asked)} given): a pipelined "
                               f"model is driven by pm.step(*batch); pass example_inputs=... with the pipeline options")
        self.module = model  # its Parameters are the user's (and become the shards)
        self.__dict__["_n_gpus"] = n_gpus
        self.__dict__["_options"] = options
        self.__dict__["_built"] = None
        self.__dict__["_signature"] = None
        # parallel_module.parallelize_with_inputs, passed in (this module sits below the driver
        # that creates it and imports nothing of it)
        self.__dict__["_builder"] = build

    @property
    def parallel_module(self):
        """The ``ParallelModule`` built on the first call (None before it)."""
        return self.__dict__["_built"]

    def forward(self, *args, **kwargs):
        signature = input_signature(args, kwargs)
        built = self.__dict__["_built"]
        if built is None:
            built = self.__dict__["_builder"](self.module, self._n_gpus, args, example_kwargs=kwargs, in_place=True,
                                            **self._options)
            self.__dict__["_built"] = built
            self.__dict__["_signature"] = signature
        elif signature != self._signature:
            raise InputSignatureError(
                f"this parallelized model was planned for inputs ({_describe(self._signature)}) and is called with "
                f"({_describe(signature)}); one lazy module runs one plan: keep the batch shape fixed (drop or pad "
                f"the last batch), or parallelize with example_inputs for each shape")
        return built(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            built = self.__dict__.get("_built")
            if built is None or name.startswith("__"):
                if name in ("plan", "program", "device_mesh", "shards", "axis_group", "full_state_dict",
                            "full_grads", "load_full_state_dict", "input_slices", "output_slices"):
                    raise AttributeError(f"{name} exists once the model has been called once: the first call "
                                         f"plans (autopar.parallelize without example_inputs is lazy)") from None
                raise
            return getattr(built, name)
