"""Save and load an elastic job's state at a resize point (the one place the real run touches checkpoints).

The state is the model's unsharded parameters (``ParallelModule.full_state_dict``) and the
optimizer's state in parameter order, written by rank 0 as one safetensors file; the job
restarted at another world size loads it on every rank. This works for plans whose optimizer
state is whole on every rank (``dp``); a sharded-checkpoint path (DCP with reshard-on-load) can
replace these two functions without touching the callers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["save_job_state", "load_job_state"]


def save_job_state(path: str | Path, model, optimizer: torch.optim.Optimizer, step: int) -> None:
    tensors = {f"model.{k}": v.detach().contiguous().clone() for k, v in model.full_state_dict().items()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        for k, v in optimizer.state.get(p, {}).items():
            tensors[f"optim.{i}.{k}"] = torch.as_tensor(v).detach().contiguous().clone()
    tensors["step"] = torch.tensor([step], dtype=torch.int64)
    tmp = Path(str(path) + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)  # a reader never sees half a file


def load_job_state(path: str | Path, model, optimizer: torch.optim.Optimizer) -> int:
    """Load what :func:`save_job_state` wrote; returns the next step to run."""
    tensors = load_file(str(path))
    model.load_full_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        state = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"optim.{i}.")}
        if state:
            optimizer.state[p] = {k: v.clone() for k, v in state.items()}
    return int(tensors["step"].item())
