"""Cross-entropy over logits split on the vocabulary (runtime.vocab_parallel_ce): one launch of
4 gloo ranks; every rank's loss and logits' gradient piece equal torch's cross-entropy on the
whole logits (fp64; bf16 to its precision), ignored rows included, and the bytes sent equal
cost_model.algorithms' price. The planner picks it under a column-parallel head, where it
sends far fewer bytes than the all-to-all into row shards it replaces."""

import os
import sys

import pytest
import torch

from autopar.cost_model.algorithms import vocab_parallel_ce_steps
from autopar.cost_model.comm import bytes_sent_per_rank

sys.path.insert(0, os.path.dirname(__file__))
from vocab_ce_cases import CASES  # noqa: E402

# One case in the session's 4-rank launch (tests/launcher.py).
LAUNCH_CASES = {4: [("vocab_ce", "vocab_ce_cases:all_cases", {})]}


@pytest.fixture
def results(launched):
    got = launched(4)["vocab_ce"]
    assert "error" not in got, got
    return got


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{a}-{r}x{c}-red{red}-ignore{i}-{str(d)[6:]}"
                                                          for a, r, c, red, i, d in CASES])
def test_vocab_parallel_ce_equals_cross_entropy_and_sends_what_is_priced(results, index):
    dtype = CASES[index][-1]
    tol = 1e-12 if dtype == torch.float64 else 0.05  # bf16: the loss is rounded once to 8 bits
    for rank, per_case in enumerate(results):
        r = per_case[index]
        assert r["out_err"] < tol and r["grad_err"] < (1e-12 if dtype == torch.float64 else 4e-3), (rank, r)
        assert r["out_dtype"] == r["grad_dtype"] == str(dtype), r
        # statistics in fp32, or fp64 for fp64 logits (the cost model's max(elem, 4))
        steps = vocab_parallel_ce_steps(r["rows"], r["n"], 0, dtype.itemsize)
        want = sum(bytes_sent_per_rank(s.collective, s.nbytes, r["n"]) for s in steps)
        assert want > 0 and r["sent"] == pytest.approx({"all_gather": want}), (rank, r["sent"], want)


def test_the_planner_runs_a_column_parallel_heads_loss_vocab_parallel():
    import autopar
    from autopar.models import GPTConfig, gpt

    model, inputs = gpt(GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=512, block_size=32),
                        batch_size=4, seq_len=32)
    plan = autopar.plan(model, 4, inputs, hardware="a100-80gb", mixed_precision=False, strategy="megatron-sp",
                        baselines=False)
    loss = plan.node("cross_entropy_loss")
    assert loss.input_layouts[0] == "S(1)" and loss.output_layout == "R", loss  # logits stay split on the vocab
    # the all-to-all of the logits into row shards (forward and backward) is gone; the head's
    # column-parallel matmul feeds the loss directly
    logits_bytes = 4 * 32 * 512 * 4 / 4  # one rank's slice of the logits, fp32
    assert plan.comm_bytes.get("all_to_all", 0) < 2 * bytes_sent_per_rank("all_to_all", logits_bytes, 4), \
        plan.comm_bytes
    assert plan.comm_bytes.get("all_gather", 0) > 0
