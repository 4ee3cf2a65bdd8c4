"""Every registered rule, every strategy it expands to, on 1-, 2- and 3-axis meshes, against
the unsharded op (all ranks simulated with LocalTensorMode). A wrong rule fails this test by name."""

import pytest
import torch
import transformers.integrations.moe  # noqa: F401  (loads transformers::grouped_mm_fallback, whose rule is by name)

from autopar.passes.rules import OpSpec, registered_ops, temporary_rule
from autopar.passes.validate import validate_rules

aten = torch.ops.aten

@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2), (2, 2, 2)], ids=["2", "2x2", "2x2x2"])
def test_every_rule_matches_the_unsharded_op(mesh_shape, report_line):
    report = validate_rules([mesh_shape])
    report_line(f"ground truth on mesh {'x'.join(map(str, mesh_shape))}: {report.summary()}")
    assert not report.rules_without_samples, f"rules without samples: {report.rules_without_samples}"
    assert not report.failures, "wrong rules:\n" + "\n".join(str(f) for f in report.failures[:50])
    assert set(report.cases_per_rule) == {str(op) for op in registered_ops()}  # every rule was exercised


def test_a_wrong_rule_is_caught_and_named():
    # Claims softmax may shard its softmax dim: false, and the validation must say so.
    wrong = lambda x, dim, half_to_float: OpSpec("abc->abc")  # noqa: E731
    with temporary_rule(aten._softmax.default, wrong, get_samples_of(aten._softmax.default)):
        report = validate_rules([(2,)], ops=[aten._softmax.default])
    assert report.failures and all(f.rule == "aten._softmax.default" for f in report.failures)
    assert any("S(2)" in f.strategy for f in report.failures)
    assert report.passed > 0  # the correct strategies among the claimed ones still pass


def get_samples_of(op):
    from autopar.passes.rules import get_rule

    return get_rule(op).samples


def test_routing_rules_that_would_split_global_offsets_or_data_ranges_are_caught():
    # The grouped matmul reads rows by global offsets and histc without a range takes the
    # data's own min and max: claiming either splits is wrong and must be named.
    grouped = torch.ops.transformers.grouped_mm_fallback.default
    rows = lambda x, w, offs: OpSpec("sk,_kn,_->sn")  # noqa: E731
    with temporary_rule(grouped, rows, get_samples_of(grouped)):
        report = validate_rules([(2,)], ops=[grouped])
    assert any("S(0), R, R -> S(0)" == f.strategy for f in report.failures), report.failures
    histc = aten.histc.default
    ranged = lambda x, bins=100, min=0, max=0: OpSpec("ab"[: x.dim()] + "->_")  # noqa: E731
    with temporary_rule(histc, ranged, get_samples_of(histc)):
        report = validate_rules([(2,)], ops=[histc])
    assert any(f.sample == 2 and f.strategy == "S(0) -> P" for f in report.failures), report.failures
