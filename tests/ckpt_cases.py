"""Multi-process checkpoint cases of tests/test_checkpoint.py: one case per phase (tests/launcher.py).

Phase ``save`` (4 ranks): train a 4-layer tiny GPT 2 AdamW steps under megatron-dp (dp=2,tp=2) and
under zero2 (dp=4: flat padded pieces) and save each; record the full weights and optimizer state
that were saved. Then a pipeline (pp=2 stages, ZeRO-3 on dp=2 inside) loads the megatron-dp
checkpoint, trains 3 steps and saves its own.
Phase ``load2`` (2 ranks) and ``load8`` (8 ranks): load those checkpoints into other plans (zero3,
zero2 on dp=2, 2.5d on 8 ranks), record what was loaded (gathered) and train 3 more steps; and
feed ``load`` a foreign, a corrupted, an incomplete and a malicious checkpoint.
Rank 0 returns the records; the test compares them bitwise with what was saved and with a
single-process run.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import zlib

import torch
import torch.distributed as dist
from launcher import scratch_dir

K, MORE = 2, 3          # steps before the checkpoint, steps after loading it
LR, EPS = 1e-3, 1e-6    # as tests/dist_cases.py
BATCH, SEQ, LAYERS = 16, 16, 4


def build():
    from autopar.models import gpt

    torch.manual_seed(0)
    return gpt("gpt-tiny", batch_size=BATCH, seq_len=SEQ, n_layer=LAYERS)


def parallel(family: str, mesh: str | None = None):
    from autopar.runtime.parallel_module import parallelize, parallelize_pipeline

    model, inputs = build()
    if family == "pp":
        pm = parallelize_pipeline(model, inputs, pp=2, n_microbatches=4, schedule="1f1b", stage_mesh="dp=2",
                                  strategy="zero3", hardware="a100-80gb", mixed_precision=False)
    else:
        pm = parallelize(model, example_inputs=inputs, hardware="a100-80gb", mixed_precision=False,
                         strategy=family, mesh=mesh, baselines=False)
    return pm, torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS), inputs


def train(pm, opt, inputs, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        if hasattr(pm, "step"):
            loss = pm.step(*inputs)
        else:
            loss = pm(*inputs)
            loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def snapshot(pm, opt) -> dict:
    from autopar.checkpoint import full_optimizer_state

    optim = full_optimizer_state(pm, opt)
    if hasattr(pm, "stages"):  # a pipeline rank holds its stages only: merge every rank's
        box = [None] * dist.get_world_size()
        dist.all_gather_object(box, optim)
        optim = {k: v for d in box for k, v in d.items()}
    # clone: full_state_dict returns a replicated weight itself, which later steps change in place
    return dict(params={k: v.clone() for k, v in pm.full_state_dict().items()}, optim=optim)


def local_numels(pm) -> dict:
    """This rank's local element count against the whole model's: the plan really shards."""
    mine = sum(p.numel() for p in pm.parameters())
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, mine)
    return dict(local=box, full=sum(p.numel() for p in build()[0].parameters()))


def save_phase(ckpt: str) -> dict:
    from autopar import checkpoint

    out = {}
    for family, mesh, name in (("megatron-dp", "dp=2,tp=2", "mdp"), ("zero2", "dp=4", "zero2")):
        pm, opt, inputs = parallel(family, mesh)
        losses = train(pm, opt, inputs, K)
        checkpoint.save(os.path.join(ckpt, name), pm, opt, extra={"step": K, "family": family})
        out[name] = dict(snapshot(pm, opt), losses=losses, numels=local_numels(pm))
    pm, opt, inputs = parallel("pp")  # 4 -> 4 into a pipeline, then the pipeline's own checkpoint
    extra = checkpoint.load(os.path.join(ckpt, "mdp"), pm, opt)
    loaded = snapshot(pm, opt)
    losses = train(pm, opt, inputs, MORE)
    checkpoint.save(os.path.join(ckpt, "pp"), pm, opt, extra={"step": K + MORE})
    out["pp<-mdp"] = dict(loaded=loaded, extra=extra, losses=losses, after=snapshot(pm, opt),
                          numels=local_numels(pm), stages=len(pm.plans))
    return out


def read_safetensors(path: str) -> dict:
    """What a Hugging Face loader would see: the index and every file's tensors (rank 0 reads)."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    tensors = {k: v for name in files for k, v in load_file(os.path.join(path, name)).items()}
    return dict(files=files, weight_map=index["weight_map"], tensors=tensors)


def load_case(ckpt: str, name: str, family: str, mesh: str | None, export: bool = False) -> dict:
    from autopar import checkpoint
    from autopar.safetensors_io import export_safetensors

    from autopar.resize import predict_bytes_read, resize

    pm, opt, inputs = parallel(family, mesh)
    predicted = [None] * dist.get_world_size()
    dist.all_gather_object(predicted, predict_bytes_read(os.path.join(ckpt, name), pm, opt))
    extra, cost = resize(os.path.join(ckpt, name), pm, opt)  # a load that reports what it read
    loaded = dict(snapshot(pm, opt), predicted=predicted, measured=list(cost.bytes_read_per_rank))
    if export:  # the loaded weights, whole, as Hugging Face safetensors in several files
        export_safetensors(os.path.join(ckpt, "hf"), pm, max_shard_bytes=300_000)
        loaded["hf"] = read_safetensors(os.path.join(ckpt, "hf")) if dist.get_rank() == 0 else None
    losses = train(pm, opt, inputs, MORE)
    return dict(loaded=loaded, extra=extra, losses=losses, params=pm.full_state_dict(), numels=local_numels(pm),
                mesh=str(pm.plan.mesh))


def _rewrite_manifest(path: str) -> None:
    """Make the manifest agree with files someone changed on purpose (an attacker would)."""
    from autopar.checkpoint import MANIFEST

    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    for name in manifest["files"]:
        data = open(os.path.join(path, name), "rb").read()
        manifest["files"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f)


def _evil_marker() -> str:
    """The file the malicious checkpoint would create if loading it ran its pickle."""
    return os.path.join(scratch_dir(), "evil_ran")


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_evil_marker()}",))


def bad_checkpoints(ckpt: str) -> dict:
    """Each bad checkpoint raises CheckpointError on every rank and leaves model and optimizer as they were."""
    from autopar import checkpoint
    from autopar.checkpoint import MANIFEST, CheckpointError

    good = os.path.join(ckpt, "mdp")
    mlp = os.path.join(ckpt, "mlp")
    from autopar.models import MLPConfig, mlp as build_mlp
    from autopar.runtime.parallel_module import parallelize

    torch.manual_seed(0)
    small, small_inputs = build_mlp(MLPConfig(in_features=32, hidden=64, out_features=8, depth=2), batch_size=16)
    spm = parallelize(small, example_inputs=small_inputs, strategy="zero3", mixed_precision=False, baselines=False)
    checkpoint.save(mlp, spm, torch.optim.AdamW(spm.parameters()))
    if dist.get_rank() == 0:
        for name in ("corrupt", "incomplete", "evil"):
            shutil.copytree(good, os.path.join(ckpt, name))
        data_file = sorted(f for f in os.listdir(os.path.join(ckpt, "corrupt")) if f.endswith(".distcp"))[0]
        with open(os.path.join(ckpt, "corrupt", data_file), "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.remove(os.path.join(ckpt, "incomplete", MANIFEST))
        with open(os.path.join(ckpt, "evil", ".metadata"), "wb") as f:
            pickle.dump(_Evil(), f)
        _rewrite_manifest(os.path.join(ckpt, "evil"))
    dist.barrier()
    pm, opt, inputs = parallel("zero3", "dp=2")
    train(pm, opt, inputs, 1)
    before = snapshot(pm, opt)
    errors = {}
    for name in ("mlp", "corrupt", "incomplete", "evil", "missing"):
        try:
            checkpoint.load(os.path.join(ckpt, name), pm, opt)
            errors[name] = None
        except CheckpointError as exc:
            errors[name] = str(exc)
    after = snapshot(pm, opt)
    from autopar.safetensors_io import import_safetensors

    import_safetensors(os.path.join(ckpt, "hf"), pm)  # exported by the zero3<-mdp case
    return dict(errors=errors, before=before, after=after, evil_ran=os.path.exists(_evil_marker()),
                imported={k: v.clone() for k, v in pm.full_state_dict().items()})


PHASES = {
    "save": lambda ckpt: save_phase(ckpt),
    "load2": lambda ckpt: {"zero3<-mdp": load_case(ckpt, "mdp", "zero3", "dp=2", export=True),
                           "zero2<-zero2": load_case(ckpt, "zero2", "zero2", "dp=2"),
                           "zero3<-pp": load_case(ckpt, "pp", "zero3", "dp=2"),
                           "bad": bad_checkpoints(ckpt)},
    "load8": lambda ckpt: {"2.5d<-mdp": load_case(ckpt, "mdp", "2.5d", None)},
}


def phase(rank: int, world: int, name: str) -> dict:
    """One phase on this rank (run by tests/launcher.py); checkpoints live under the scratch dir."""
    return PHASES[name](os.path.join(scratch_dir(), "ckpt"))
