"""Sharded checkpoints (autopar.checkpoint on DCP): save under one plan, load under another.

Three phases in the session's launches (tests/ckpt_cases.py): save at 4 ranks (megatron-dp 2x2,
zero2 on dp=4) and load the megatron-dp checkpoint into a 2-stage pipeline (4 -> 4); load at 2 ranks (zero3, zero2 on dp=2, and
the pipeline's checkpoint into zero3) with the bad checkpoints; load at 8 ranks under 2.5d. What was
loaded must equal what was saved bitwise (weights and AdamW state, gathered), and 3 more steps
must equal an uninterrupted single-process run.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_cases import EPS, K, LR, MORE, build  # noqa: E402


# Three phases in the session's 4-, 2- and 8-rank launches (tests/launcher.py); save first: the loads read it.
PHASES = ((4, "save"), (2, "load2"), (8, "load8"))
LAUNCH_CASES = {world: [(name, "ckpt_cases:phase", {"name": name})] for world, name in PHASES}
LAUNCH_ORDER = tuple(world for world, _ in PHASES)


@pytest.fixture
def runs(launched):
    out = {}
    for world, name in PHASES:
        got = launched(world)[name]
        assert "error" not in got, got["error"]
        out.update(got)
    return out


@pytest.fixture(scope="module")
def single():
    """One process, uninterrupted: K steps, the state then, and MORE steps after."""
    model, inputs = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, at_k = [], None
    for step in range(K + MORE):
        if step == K:
            at_k = {k: v.detach().clone() for k, v in model.state_dict().items()}
        loss = model(*inputs)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, at_k=at_k, params={k: v.detach() for k, v in model.state_dict().items()})


def assert_bitwise(saved: dict, loaded: dict) -> None:
    assert set(saved["params"]) == set(loaded["params"]) and set(saved["optim"]) == set(loaded["optim"])
    for k, v in saved["params"].items():
        assert torch.equal(v, loaded["params"][k]), f"weight {k} differs after load"
    for name, state in saved["optim"].items():
        assert set(state) == set(loaded["optim"][name]) == {"step", "exp_avg", "exp_avg_sq"}
        for key, v in state.items():
            assert torch.equal(v, loaded["optim"][name][key]), f"optimizer {key} of {name} differs after load"


def assert_sharded(numels: dict) -> None:
    """Every rank holds less than the whole model: the plan the checkpoint was loaded into shards."""
    assert all(n < numels["full"] for n in numels["local"]), numels


@pytest.mark.parametrize("case, saved_as", [("zero3<-mdp", "mdp"), ("2.5d<-mdp", "mdp"), ("pp<-mdp", "mdp"),
                                            ("zero2<-zero2", "zero2")])
def test_reshard_on_load_is_bitwise_and_trains_on(runs, single, case, saved_as):
    saved, r = runs[saved_as], runs[case]
    torch.testing.assert_close(torch.tensor(saved["losses"]), torch.tensor(single["losses"][:K]), rtol=1e-5, atol=1e-5)
    assert_sharded(saved["numels"])
    assert_sharded(r["numels"])
    assert_bitwise(saved, r["loaded"])
    assert r["extra"] == {"step": K, "family": saved_as.replace("mdp", "megatron-dp")}
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(single["losses"][K:]), rtol=1e-5, atol=1e-5)
    after = r["after"]["params"] if "after" in r else r["params"]
    for k, v in single["params"].items():
        torch.testing.assert_close(after[k], v, rtol=1e-4, atol=2e-5, msg=lambda m: f"param {k}: {m}")


def test_pipeline_checkpoint_loads_into_zero3(runs):
    """A pipeline writes its stages' pieces from different ranks; zero3 on 2 ranks reads them back whole."""
    assert runs["pp<-mdp"]["stages"] == 2
    assert_bitwise(runs["pp<-mdp"]["after"], runs["zero3<-pp"]["loaded"])
    assert runs["zero3<-pp"]["extra"] == {"step": K + MORE}


def test_bad_checkpoints_fail_clearly_and_change_nothing(runs):
    bad = runs["bad"]
    errors = bad["errors"]
    assert "saved from model 'MLP'" in errors["mlp"] and "not this model 'GPT'" in errors["mlp"]
    assert "corrupted" in errors["corrupt"] and ".distcp does not match its checksum" in errors["corrupt"]
    assert "autopar_manifest.json" in errors["incomplete"] and "did not finish" in errors["incomplete"]
    assert "posix.system is not allowed" in errors["evil"] and not bad["evil_ran"]
    assert "no checkpoint directory" in errors["missing"]
    assert_bitwise(bad["before"], bad["after"])


def test_safetensors_export_is_whole_and_imports_into_another_plan(runs):
    """zero3 on 2 ranks exports the loaded weights (several files and an index, as save_pretrained);
    they equal the saved weights bitwise, and import back into a zero3 model that trained elsewhere."""
    saved = runs["mdp"]["params"]
    hf = runs["zero3<-mdp"]["loaded"]["hf"]
    assert len(hf["files"]) > 1 and set(hf["weight_map"]) == set(hf["tensors"])
    names = {k for k in saved if k in hf["tensors"]}
    assert names == set(hf["tensors"]) and len(names) >= len(saved) - 1  # a tied weight is exported once
    for k in names:
        assert torch.equal(hf["tensors"][k], saved[k]), k
    for k in names:
        assert torch.equal(runs["bad"]["imported"][k], saved[k]), k


@pytest.mark.parametrize("case", ["zero3<-mdp", "2.5d<-mdp", "zero2<-zero2", "zero3<-pp"])
def test_migration_cost_predicted_from_metadata_equals_bytes_read(runs, case):
    """The price of a migration before it runs: each rank's bytes from the checkpoint's metadata."""
    loaded = runs[case]["loaded"]
    assert loaded["predicted"] == loaded["measured"] and min(loaded["measured"]) > 0
