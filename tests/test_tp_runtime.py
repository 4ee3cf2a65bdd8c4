"""Multi-dimensional tensor parallel and sequence parallel plans, run for real (gloo, one
launch per world size, shared): 2D on a 2x2 grid, 2.5D and 3D on 2x2x2, Ulysses, ring attention and
Megatron-SP on 4 ranks, for the tiny GPT and the tiny BERT. Each equals the single-process run
(loss, gradients, parameters after 3 AdamW steps) and sends exactly the bytes its plan
predicts. A sequence too long to fit without sequence parallelism is planned and run with it."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from dist_cases import build, case_key  # noqa: E402
from test_runtime import assert_matches_single_process, assert_runs_as_planned, case_id  # noqa: E402

LONG_SEQ_BUDGET = 3.5e6  # bytes per device: fits with the sequence split (3.25 MB), not without (megatron needs 4.14 MB)
SUMMA_BUDGET = 0.86e6  # 2D under this budget runs linear layers by SUMMA's panel loop (free 2D plan: 0.90 MB memory row, 1.03 MB walked)
CASES_BY_WORLD = {
    4: [(m, f, None) for m in ("gpt-tiny", "bert-tiny") for f in ("2d", "ulysses", "ring", "megatron-sp")]
       + [("gpt-tiny", "ring", "sp=4"), ("gpt-tiny", "2d", None, {"memory_budget_bytes": SUMMA_BUDGET}),
          ("gpt-longseq", "auto", None, {"memory_budget_bytes": LONG_SEQ_BUDGET})],
    8: [(m, f, None) for m in ("gpt-tiny", "bert-tiny") for f in ("2.5d", "3d")]
       + [("gpt-tiny", "2d", "row=2,col=4"), ("bert-tiny", "ulysses", "dp=2,sp=4"), ("gpt-tiny", "ring", "dp=2,sp=4"),
          ("bert-tiny", "megatron-sp", None)],
}
CASES = [(w, c) for w, cases in CASES_BY_WORLD.items() for c in cases]
# One launch per world size (tests/launcher.py), shared with other test files' cases.
LAUNCH_CASES = {w: [(case_key(c), "dist_cases:case", {"spec": c}) for c in cases] for w, cases in CASES_BY_WORLD.items()}


def _plan(case, world):
    import autopar

    name, family, mesh, *options = case
    model, inputs = build(name)
    return autopar.plan(model, world, inputs, hardware="a100-80gb", mixed_precision=False, strategy=family,
                        mesh=mesh, baselines=False, **(options[0] if options else {}))


# what each family's plan must turn out to be (autopar.tp_families.layout_kind)
EXPECTED_KIND = {"2d": "2D", "2.5d": "2.5D", "3d": "3D", "ulysses": "SP", "ring": "SP", "megatron-sp": "1D+SP"}


@pytest.mark.slow
@pytest.mark.parametrize("world_case", CASES, ids=[case_id(c) for c in CASES])
def test_layout_runs_equal_single_process_and_bytes_match(launched, world_case, report_line):
    from autopar.tp_families import layout_kind

    world, case = world_case
    name, family = case[0], case[1]
    r = launched(world)[case_key(case)]
    assert "error" not in r, r.get("error")
    assert_matches_single_process(r, name)
    assert_runs_as_planned(r, family, world)  # pieces, bytes (every rank and step), split compute
    plan = _plan(case, world)
    assert str(plan.mesh) == r["mesh"] and plan.comm_bytes == pytest.approx(r["predicted"])
    kind = layout_kind(plan)
    if family in EXPECTED_KIND:
        want = EXPECTED_KIND[family]
        if want == "SP":  # alone, or with data parallelism on the other axis
            assert kind.split("+")[-1] == "SP", (family, kind)
        else:
            assert kind.split("+")[0] == want.split("+")[0] and ("SP" in kind or "SP" not in want), (family, kind)
    attention = [s for n, s in r["strategies"].items() if "scaled_dot_product_attention" in n]
    if family == "ring":  # K/V go around the ring: point-to-point bytes, sequence-split keys
        assert r["predicted"].get("p2p", 0) > 0 and attention
    if len(case) > 3 and case[3].get("memory_budget_bytes") == SUMMA_BUDGET:  # SUMMA's broadcasts and reduces
        assert r["predicted"].get("broadcast", 0) > 0 and r["predicted"].get("reduce", 0) > 0
    if family == "ulysses":  # attention over heads, reached by all-to-all from the sequence split
        assert r["predicted"].get("all_to_all", 0) > 0 and "p2p" not in r["predicted"]
    report_line(f"layouts {world} ranks {case_key(case).replace('/None', '')}: mesh {r['mesh']} ({kind}), "
                f"bytes/step {sum(r['predicted'].values()):,.0f} (measured = predicted)")


@pytest.mark.slow
def test_a_sequence_that_fits_only_when_split_is_planned_and_run_with_it(launched):
    import autopar
    from autopar.errors import AutoparError
    from autopar.report import format_report
    from autopar.tp_families import layout_kind

    case = CASES_BY_WORLD[4][-1]
    r = launched(4)[case_key(case)]
    assert "error" not in r, r.get("error")
    plan = _plan(case, 4)
    assert plan.peak_memory_bytes_per_device <= LONG_SEQ_BUDGET
    assert "SP" in layout_kind(plan)
    assert "sequence parallel" in format_report(plan)
    # the same budget without sequence parallelism (and without recompute, which trades time
    # for the same memory): tensor parallelism (activations whole between layers), data
    # parallelism (a batch of one) and ZeRO cannot fit
    model, inputs = build(case[0])
    for family in ("megatron", "dp", "zero3", "megatron-dp"):
        with pytest.raises(AutoparError):
            autopar.plan(model, 4, inputs, hardware="a100-80gb", mixed_precision=False, strategy=family,
                         memory_budget_bytes=LONG_SEQ_BUDGET, baselines=False, pipeline=False, recompute="none")
