"""Expert parallelism on 4 gloo ranks: a tiny Hugging Face Mixtral (4 experts, top-2) with its
experts split over the ranks equals one process, and the all-to-all bytes each rank sends
equal the prediction from the router's counts."""

import pytest
import torch
from ep_cases import BATCH, EPS, LR, SEQ, STEPS, build_mixtral

from autopar.runtime.expert_parallel import predict_bytes

WORLD = 4
# Run in the session's shared 4-rank launch (tests/launcher.py).
LAUNCH_CASES = {WORLD: [("ep", "ep_cases:case_mixtral_ep", {}),
                        ("ep_broken", "ep_cases:case_mixtral_ep", {"break_combine_scale": True}),
                        ("ep_8_experts", "ep_cases:case_mixtral_ep", {"experts": 8})]}


@pytest.fixture
def results(launched):
    return launched(WORLD)


@pytest.fixture(scope="module")
def reference():
    return _reference(4)


def _reference(experts: int) -> dict:
    """One process, whole batch: losses, first gradients, final parameters, each step's routing."""
    model, inputs = build_mixtral(experts=experts)
    routing: list[list[torch.Tensor]] = []
    for layer in model.model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, i, out: routing[-1].append(out[2].detach().clone()))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, grads = [], None
    for step in range(STEPS):
        routing.append([])
        loss = model(*inputs)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, grads=grads, params={n: p.detach() for n, p in model.named_parameters()},
                routing=routing, config=model.model.config)


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{what}: {m}")


def test_expert_parallel_mixtral_equals_one_process(results, reference):
    _assert_equal(results["ep"], reference)


def test_two_experts_per_rank_equal_one_process(results):
    # Two local experts: the rows that arrive are regrouped by expert and put back in order.
    r = results["ep_8_experts"]
    assert all(shape[0] == 2 for shape in r.get("local_expert_shapes", {}).values()), r.get("error")
    _assert_equal(r, _reference(8))


def _assert_equal(r: dict, reference: dict) -> None:
    assert "error" not in r, r.get("error")
    _close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), "losses")
    assert r["grads"].keys() == reference["grads"].keys()
    for name, g in reference["grads"].items():
        _close(r["grads"][name], g, f"gradient of {name}")
    for name, p in reference["params"].items():
        _close(r["params"][name], p, f"{name} after {STEPS} AdamW steps")


def test_each_rank_holds_only_its_experts(results, reference):
    r = results["ep"]
    cfg = reference["config"]
    per_rank = cfg.num_local_experts // WORLD
    assert r["replaced"] == [f"model.model.layers.{i}.mlp.experts" for i in range(cfg.num_hidden_layers)]
    assert len(r["local_expert_shapes"]) == 2 * cfg.num_hidden_layers
    for name, shape in r["local_expert_shapes"].items():
        full = tuple(reference["params"][name].shape)
        assert shape == (per_rank,) + full[1:] and full[0] == cfg.num_local_experts, (name, shape, full)


def test_measured_all_to_all_bytes_equal_the_prediction_on_every_rank(results, reference, report_line):
    cfg = reference["config"]
    tokens = BATCH // WORLD * SEQ
    for step, layers in enumerate(reference["routing"]):
        predicted = [0.0] * WORLD
        for top_k in layers:  # the router's choices for the whole batch, cut as the ranks hold it
            for rank, b in enumerate(predict_bytes(list(top_k.split(tokens)), cfg.num_local_experts,
                                                   cfg.hidden_size, 4)):
                predicted[rank] += b["all_to_all"]
        measured = [sent[step] for sent in results["ep"]["sent_per_rank"]]
        assert measured == pytest.approx(predicted, rel=1e-12), f"step {step}"
        assert min(measured) > 0
        if step == 0:
            report_line(f"expert parallel, tiny Mixtral on {WORLD} ranks: all-to-all bytes per rank, step 1 "
                        f"(measured = predicted from the router's counts): {[int(b) for b in measured]}")


def test_a_wrong_gradient_scale_of_the_experts_is_caught(results, reference):
    # The same run with the expert gradients left summed over ranks (not averaged): the first
    # gradients of the experts must differ from one process's by the world size.
    r = results["ep_broken"]
    name = "model.model.layers.0.mlp.experts.down_proj"
    _close(r["grads"][name], reference["grads"][name] * WORLD, "broken run's expert gradient")
    with pytest.raises(AssertionError):
        _close(r["grads"][name], reference["grads"][name], "expert gradient")


# Mixtral-shaped (hidden 4096, 14336 per expert, 8 experts, top-2), 8 MoE layers: 11.3e9 expert
# parameters, 180 GiB with AdamW replicated - more than an 80 GB device holds.
MIXTRAL_8L = dict(layers=8, experts=8, top_k=2, hidden=4096, intermediate=14336, dense_params=600_000_000,
                  tokens_per_device=4096)


def test_expert_parallel_is_chosen_where_replicated_experts_do_not_fit():
    from autopar.cost_model.hardware import get_hardware
    from autopar.techniques.expert_parallel import MoEShape, choose, price

    hw = get_hardware("a100-80gb")
    shape = MoEShape(**MIXTRAL_8L)
    for n in (8, 64):
        replicated = price(shape, n, hw.intra_node)
        assert replicated.memory_bytes > hw.memory_bytes  # the premise: experts do not fit replicated
        best = choose(shape, n, hw.memory_bytes, hw.intra_node)
        assert best.strategy == "expert_parallel" and best.memory_bytes <= hw.memory_bytes, best
        assert shape.experts % best.ep == 0 and n % best.ep == 0
    # A small MoE whose experts fit: the choice is by time, and the data-parallel all-reduce of
    # tiny expert gradients beats four all-to-alls of every token.
    tiny = MoEShape(layers=2, experts=4, top_k=2, hidden=16, intermediate=32, dense_params=10_000,
                    tokens_per_device=65_536)
    assert choose(tiny, 8, hw.memory_bytes, hw.intra_node).strategy == "replicated"


def test_planned_bytes_at_even_routing_match_the_measured_counts_formula():
    # With every rank's pairs spread evenly over the experts, the capacity price (factor 1)
    # equals the runtime's per-count prediction exactly.
    from autopar.techniques.expert_parallel import MoEShape, planned_all_to_all_bytes

    E, ep, tokens, k, H = 4, 4, 8, 2, 16
    top_k = [torch.arange(tokens * k).remainder(E).view(tokens, k) for _ in range(ep)]
    shape = MoEShape(layers=1, experts=E, top_k=k, hidden=H, intermediate=32, dense_params=0, tokens_per_device=tokens)
    for b in predict_bytes(top_k, E, H, 4):
        assert b["all_to_all"] == planned_all_to_all_bytes(shape, ep)
