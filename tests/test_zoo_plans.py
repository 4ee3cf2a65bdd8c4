"""Every zoo model plans with default options (what `autopar plan NAME --gpus N` does), at 8
devices and, for the large ones, at the scale they are meant for. A candidate the search
cannot build (e.g. a pipeline cut through weights tied across stages) is skipped, never a
failure of the whole plan."""

import pytest

import autopar
from autopar.errors import AutoparError
from autopar.models import ZOO, get_model

# The scale each large model is planned for besides 8 devices (the README's examples).
AT_SCALE = {"gpt2-xl": 64, "gpt3-175b": 1024}
# 175B parameters need ~2.8 TB of mixed-precision training state: 8 devices of 80 GB cannot hold it.
CANNOT_FIT = {("gpt3-175b", 8)}
CASES = [(name, 8) for name in ZOO] + list(AT_SCALE.items())


@pytest.mark.slow
@pytest.mark.parametrize("name,gpus", CASES, ids=[f"{n}-{g}" for n, g in CASES])
def test_every_zoo_model_plans_with_default_options(name, gpus):
    model, inputs = get_model(name, device="meta")
    if (name, gpus) in CANNOT_FIT:  # a clear answer, not a crash
        with pytest.raises(AutoparError, match="fit|memory"):
            autopar.plan(model, gpus, inputs)
        return
    plan = autopar.plan(model, gpus, inputs)
    assert plan.n_devices == gpus and plan.step_seconds > 0
    assert 0 < plan.peak_memory_bytes_per_device <= plan.memory_budget_bytes
