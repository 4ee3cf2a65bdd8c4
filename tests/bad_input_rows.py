"""The bad-input table of tests/test_bad_inputs.py: the rows and what they use.

CLI rows run ``autopar.cli.main`` (what the ``autopar`` script calls) in this process and expect
exit code 2 with ``autopar...: error: ...`` on stderr: at most 3 lines, no "Traceback", no torch
log lines. API rows expect an ``AutoparError`` subclass whose message holds the bad value and a
phrase naming the fix, with the original exception chained where one was wrapped, nothing on
stderr, and the model's parameters and buffers bitwise as they were.

A new row is one line in ``CLI_ROWS`` or ``API_ROWS``. API rows call ``fn(ctx)``; ``ctx.model``
and ``ctx.inputs`` are a fresh seeded model (the row's ``model``), ``ctx.files`` a folder of bad
files (``ctx.file(name)``), ``ctx.plan_json(name, n)`` a plan made for a zoo model. Rows with
``pg=True`` run inside a 1-rank gloo process group (``autopar.runtime.parallel_module.parallelize`` needs one).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import autopar
from autopar.checkpoint import CheckpointError
from autopar.cost_model.hardware import HardwareError
from autopar.cost_model.ilp import InfeasibleBudgetError
from autopar.errors import AutoparError, BadArgumentError, TraceError
from autopar.mesh import MeshError
from autopar.models import get_model
from autopar.plan import PlanFormatError
from autopar.optim import LAMB, LARS
from autopar.optim.hyper import OptimizerConfigError
from autopar.runtime.parallel_module import parallelize
from autopar.runtime.lazy import InputSignatureError
from autopar.runtime.materialize import WeightsError

# --- what the rows use ----------------------------------------------------------------------

# A user's package with model factories, importable from the current directory only (as a
# user's own code is): the CLI rows run from the folder that holds it.
FACTORIES = '''
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        if y.sum() > 0:  # data-dependent control flow: untraceable
            return y.relu().sum()
        return y.sum()


def branchy(batch_size=4, seq_len=None):
    torch.manual_seed(0)
    return Branchy(), (torch.randn(batch_size, 8),)


def wrong(batch_size=None, seq_len=None):
    return 42


def broken(batch_size=None, seq_len=None):
    raise RuntimeError("config file missing")
'''

BAD_FILES = {
    "malformed.json": "{not json",
    "fields.json": json.dumps({"name": "my-gpu", "peak_flops": 1e12}),
    "binary.json": b"\xff\xfe\x00garbage",
    "plan_v99.json": json.dumps({"format_version": 99}),
}


class NoParams(nn.Module):
    def forward(self, x):
        return (x * 2).sum()


def _branchy():
    from autopar_badpkg.factories import branchy  # written by the `ctx` fixture

    return branchy()


def _mlp():
    torch.manual_seed(0)
    return get_model("mlp", batch_size=8)


def _gpt():
    torch.manual_seed(0)
    return get_model("gpt-tiny", batch_size=2, seq_len=16)


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "mlp": _mlp, "gpt": _gpt, "branchy": _branchy, "noparams": lambda: (NoParams(), (torch.randn(4, 4),)),
}


def _load_checkpoint(c, path) -> None:
    """``autopar.checkpoint.load`` into a parallelized model (the user's model is what must not change)."""
    from autopar import checkpoint

    checkpoint.load(path, parallelize(c.model, example_inputs=c.inputs))


def _lazy_other_shape(c) -> None:
    """The one-line API's lazy module plans on its first batch; a batch of another shape is refused."""
    pm = autopar.parallelize(c.model)
    pm(*c.inputs)
    pm(torch.cat([c.inputs[0], c.inputs[0]]), *c.inputs[1:])


@lru_cache(maxsize=None)
def _plan_json(name: str, n: int) -> str:
    model, inputs = MODELS[name]()
    return autopar.plan(model, n, inputs, baselines=False).to_json()


@dataclass
class Ctx:
    model: nn.Module | None
    inputs: tuple
    files: str

    def file(self, name: str) -> str:
        return os.path.join(self.files, name)

    @staticmethod
    def plan_json(name: str, n: int) -> str:
        return _plan_json(name, n)


# --- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cli:
    """``autopar ARGV`` exits 2; stderr names ``value`` and ``fix`` in at most 3 lines."""
    name: str
    argv: str
    value: str
    fix: str


@dataclass(frozen=True)
class Api:
    """``fn(ctx)`` raises ``error`` (an AutoparError) naming ``value`` and ``fix``; ``cause``:
    the wrapped original exception's type, kept as ``__cause__``."""
    name: str
    fn: Callable[[Ctx], Any]
    error: type[AutoparError]
    value: str
    fix: str
    model: str | None = None
    cause: type[BaseException] | None = None
    pg: bool = False


CLI_ROWS = [
    Cli("unknown model", "plan nosuch --gpus 8", "'nosuch'", "autopar zoo"),
    Cli("factory module missing", "plan autopar_badpkg.nosuch:build --gpus 8", "autopar_badpkg.nosuch", "PYTHONPATH"),
    Cli("factory package missing", "trace nopkg_xyz.models:build", "nopkg_xyz", "PYTHONPATH"),
    Cli("factory attribute missing", "plan autopar_badpkg.factories:nosuch --gpus 8", "'nosuch'", "name a function"),
    Cli("factory spec malformed", "plan autopar_badpkg.factories: --gpus 8", "autopar_badpkg.factories:",
        "package.module:function"),
    Cli("factory returns the wrong thing", "plan autopar_badpkg.factories:wrong --gpus 8", "returned int",
        "must return (model, example_inputs)"),
    Cli("factory raises", "trace autopar_badpkg.factories:broken", "config file missing", "fix the factory"),
    Cli("zero GPUs", "plan mlp --gpus 0", "--gpus: 0", "at least 1"),
    Cli("negative GPUs", "plan mlp --gpus -4", "--gpus: -4", "at least 1"),
    Cli("non-integer GPUs", "plan mlp --gpus 2.5", "'2.5'", "not an integer"),
    Cli("mesh not matching the device count", "plan mlp --gpus 8 --mesh dp=2,tp=2", "dp(2) * tp(2) = 4",
        "multiply to 8"),
    Cli("malformed mesh", "plan mlp --gpus 8 --mesh dp2", "'dp2'", "name=size"),
    Cli("malformed trace mesh", "trace mlp --mesh dp=2,,tp", "'tp'", "name=size"),
    Cli("unknown hardware", "plan mlp --gpus 2 --hardware a100", "'a100'", "did you mean 'a100-80gb'"),
    Cli("hardware JSON missing", "plan mlp --gpus 2 --hardware {files}/nosuch.json", "nosuch.json", "autopar calibrate"),
    Cli("hardware JSON malformed", "plan mlp --gpus 2 --hardware {files}/malformed.json", "malformed.json",
        "autopar calibrate --out"),
    Cli("hardware JSON not UTF-8", "plan mlp --gpus 2 --hardware {files}/binary.json", "binary.json",
        "autopar calibrate --out"),
    Cli("hardware JSON missing fields", "plan mlp --gpus 2 --hardware {files}/fields.json", "missing devices_per_node",
        "fields are"),
    Cli("unreadable memory size", "plan mlp --gpus 2 --memory-budget lots", "lots", "e.g. 40GB"),
    Cli("zero memory size", "plan mlp --gpus 2 --memory-budget 0GB", "0GB", "e.g. 40GB"),
    Cli("infeasible budget", "plan mlp --gpus 2 --memory-budget 1KB --quiet --no-baselines", "1.0 KiB", "raise --memory-budget"),
    Cli("unknown strategy", "plan mlp --gpus 2 --strategy fsdp", "fsdp", "pick one of auto, dp"),
    Cli("unknown optimizer", "plan mlp --gpus 2 --optimizer lion --quiet", "'lion'", "pick one of adam"),
    Cli("untraceable control flow", "plan autopar_badpkg.factories:branchy --gpus 2 --quiet", "if y.sum() > 0:",
        "torch.where"),
    Cli("sequence longer than the model's", "plan gpt-tiny --gpus 2 --seq 100000", "seq_len=100000", "must be in [1,"),
    Cli("plan written to a missing folder", "plan mlp --gpus 2 --json {files}/no/dir/plan.json", "no/dir/plan.json",
        "existing folder"),
    Cli("HTML written to a folder", "plan mlp --gpus 2 --html {files}", "--html", "pick a file path"),
    Cli("validate mesh shape malformed", "validate --meshes 2x,2", "'2x'", "e.g. 2,2x2,2x2x2"),
    Cli("zoo with an argument", "zoo gpt2", "gpt2", "autopar --help"),
    Cli("demo with an argument", "demo gpt2", "gpt2", "autopar --help"),
    Cli("no command", "", "command", "autopar --help"),
    Cli("unknown command", "plna gpt2", "'plna'", "choose from"),
    Cli("calibrate zero ranks", "calibrate --nproc 0", "--nproc: 0", "at least 1"),
    Cli("calibrate one rank without links", "calibrate --nproc 1 --device cpu", "one rank", "--links-from"),
    Cli("calibrate links from unknown profile", "calibrate --links-from h100 --device cpu", "'h100'",
        "did you mean 'h100-80gb'"),
    Cli("calibrate output to a missing folder", "calibrate --out {files}/no/dir/hw.json", "no/dir/hw.json",
        "existing folder"),
    Cli("calibrate unknown device", "calibrate --device tpu", "'tpu'", "choose from"),
    Cli("unknown recompute mode", "plan mlp --gpus 2 --recompute some", "'some'", "choose from"),
    Cli("schedule: GPUs not whole nodes", "schedule --gpus 12", "12 GPUs", "multiple of 8"),
    Cli("schedule: unknown policy", "schedule --policy nosuch", "'nosuch'", "pick one of fifo"),
    Cli("schedule: trace missing", "schedule --trace {files}/nosuch.csv", "nosuch.csv", "Philly CSV format"),
    Cli("schedule: malformed seed", "schedule --seed x", "'x'", "0-4"),
]


API_ROWS = [
    # autopar.trace
    Api("trace: not a module", lambda c: autopar.trace("gpt2", ()), TraceError, "got str", "pass the model object"),
    Api("trace: no example inputs", lambda c: autopar.trace(c.model, ()), TraceError, "missing a required argument: 'x'",
        "one value per argument of forward()", "mlp", TypeError),
    Api("trace: inputs of the wrong shape", lambda c: autopar.trace(c.model, (torch.randn(8, 5),)), TraceError,
        "float32[8,5]", "shapes and dtypes forward() expects", "mlp", RuntimeError),
    Api("trace: inputs of the wrong dtype", lambda c: autopar.trace(c.model, (c.inputs[0].float(),)), TraceError,
        "float32[2,16]", "shapes and dtypes forward() expects", "gpt", RuntimeError),
    Api("trace: too many inputs", lambda c: autopar.trace(c.model, c.inputs * 3), TraceError, "too many",
        "one value per argument of forward()", "mlp", TypeError),
    Api("trace: untraceable control flow", lambda c: autopar.trace(c.model, c.inputs), TraceError, "if y.sum() > 0:",
        "torch.cond", "branchy", Exception),
    # autopar.plan
    Api("plan: zero GPUs", lambda c: autopar.plan(c.model, 0, c.inputs), BadArgumentError, "got 0",
        "pass the number of devices", "mlp"),
    Api("plan: non-integer GPUs", lambda c: autopar.plan(c.model, 2.5, c.inputs), BadArgumentError, "2.5",
        "positive integer", "mlp"),
    Api("plan: GPU count as a string", lambda c: autopar.plan(c.model, "8", c.inputs), BadArgumentError, "'8'",
        "positive integer", "mlp"),
    Api("plan: GPU count as a bool", lambda c: autopar.plan(c.model, True, c.inputs), BadArgumentError, "True",
        "positive integer", "mlp"),
    Api("plan: mesh not matching the device count", lambda c: autopar.plan(c.model, 8, c.inputs, mesh="dp=2,tp=2"),
        MeshError, "= 4 != 8", "multiply to 8", "mlp"),
    Api("plan: malformed mesh", lambda c: autopar.plan(c.model, 8, c.inputs, mesh="dp=two"), MeshError, "'dp=two'",
        "name=size", "mlp"),
    Api("plan: unknown hardware", lambda c: autopar.plan(c.model, 2, c.inputs, hardware="h100"), HardwareError,
        "'h100'", "did you mean 'h100-80gb'", "mlp"),
    Api("plan: malformed hardware JSON", lambda c: autopar.plan(c.model, 2, c.inputs, hardware=c.file("malformed.json")),
        HardwareError, "malformed.json", "autopar calibrate --out", "mlp", json.JSONDecodeError),
    Api("plan: negative memory budget", lambda c: autopar.plan(c.model, 2, c.inputs, memory_budget_bytes=-5),
        BadArgumentError, "-5", "positive number of bytes", "mlp"),
    Api("plan: infeasible budget", lambda c: autopar.plan(c.model, 2, c.inputs, memory_budget_bytes=1000),
        InfeasibleBudgetError, "1000 B", "at least that", "mlp"),
    Api("plan: unknown strategy", lambda c: autopar.plan(c.model, 2, c.inputs, strategy="fsdp"), AutoparError,
        "'fsdp'", "pick one of", "mlp"),
    Api("plan: unknown optimizer", lambda c: autopar.plan(c.model, 2, c.inputs, optimizer="lion"), BadArgumentError,
        "'lion'", "pick one of", "mlp"),
    Api("plan: no example inputs", lambda c: autopar.plan(c.model, 2), TraceError, "'x'",
        "one value per argument of forward()", "mlp", TypeError),
    Api("plan: model with no parameters", lambda c: autopar.plan(c.model, 2, c.inputs), BadArgumentError, "NoParams",
        "nn.ModuleList", "noparams"),
    Api("plan: untraceable control flow", lambda c: autopar.plan(c.model, 2, c.inputs), TraceError, "Branchy",
        "torch.where", "branchy", Exception),
    # Plan.from_json
    Api("Plan.from_json: truncated", lambda c: autopar.Plan.from_json(c.plan_json("mlp", 2)[:300]), PlanFormatError,
        "truncated", "re-plan", cause=json.JSONDecodeError),
    Api("Plan.from_json: empty", lambda c: autopar.Plan.from_json(""), PlanFormatError, "''", "Plan.to_json"),
    Api("Plan.from_json: not an object", lambda c: autopar.Plan.from_json("[1, 2]"), PlanFormatError, "list",
        "Plan.to_json"),
    Api("Plan.from_json: missing file", lambda c: autopar.Plan.from_json(c.file("nosuch.json")), PlanFormatError,
        "nosuch.json", "the path that", cause=FileNotFoundError),
    Api("Plan.from_json: not a string or path", lambda c: autopar.Plan.from_json(42), PlanFormatError, "got 42",
        "Plan.to_json"),
    Api("Plan.from_json: missing file as a Path", lambda c: autopar.Plan.from_json(Path(c.file("gone.json"))),
        PlanFormatError, "gone.json", "the path that", cause=FileNotFoundError),
    Api("Plan.from_json: missing fields", lambda c: autopar.Plan.from_json('{"format_version": 1}'), PlanFormatError,
        "'mesh'", "Plan.to_json", cause=KeyError),
    Api("Plan.from_json: other format version", lambda c: autopar.Plan.from_json(c.file("plan_v99.json")),
        PlanFormatError, "format_version 99", "Plan.to_json", cause=ValueError),
    Api("Plan.from_json: not UTF-8", lambda c: autopar.Plan.from_json(c.file("binary.json")), PlanFormatError,
        "binary.json", "the path that", cause=UnicodeDecodeError),
    Api("MeshSpec.parse: malformed", lambda c: autopar.MeshSpec.parse("dp=2;tp=4"), MeshError, "'dp=2;tp=4'",
        "name=size"),
    # autopar.runtime.parallel_module.parallelize
    Api("parallelize: no process group", lambda c: parallelize(c.model, example_inputs=c.inputs), AutoparError,
        "torch.distributed", "launch with torchrun", "mlp"),
    Api("parallelize: n_gpus not the world size", lambda c: parallelize(c.model, 2, c.inputs), AutoparError,
        "n_gpus=2", "launch 2 processes", "mlp", pg=True),
    Api("parallelize: plan for another world size",
        lambda c: parallelize(c.model, example_inputs=c.inputs, plan=c.plan_json("mlp", 2)), AutoparError,
        "for 2 devices", "re-plan", "mlp", pg=True),
    Api("parallelize: plan for another model",
        lambda c: parallelize(c.model, example_inputs=c.inputs, plan=c.plan_json("gpt", 1)), AutoparError,
        "'GPT'", "re-plan", "mlp", pg=True),
    Api("parallelize: malformed plan",
        lambda c: parallelize(c.model, example_inputs=c.inputs, plan='{"format_version": 1}'), PlanFormatError,
        "'mesh'", "Plan.to_json", "mlp", KeyError, pg=True),
    Api("parallelize: unknown strategy", lambda c: parallelize(c.model, example_inputs=c.inputs, strategy="fsdp"),
        AutoparError, "'fsdp'", "pick one of", "mlp", pg=True),
    Api("parallelize: mesh not matching the world size",
        lambda c: parallelize(c.model, example_inputs=c.inputs, mesh="dp=2"), MeshError, "2 != 1", "multiply to 1",
        "mlp", pg=True),
    Api("parallelize: inputs of the wrong shape",
        lambda c: parallelize(c.model, example_inputs=(torch.randn(8, 5),)), TraceError, "float32[8,5]",
        "shapes and dtypes", "mlp", RuntimeError, pg=True),
    Api("parallelize: untraceable control flow", lambda c: parallelize(c.model, example_inputs=c.inputs), TraceError,
        "if y.sum() > 0:", "torch.where", "branchy", Exception, pg=True),
    Api("parallelize: micro-batches without a pp mesh",
        lambda c: parallelize(c.model, example_inputs=c.inputs, n_microbatches=2), AutoparError, "got None",
        "mesh='pp=2,dp=2'", "gpt", pg=True),
    Api("parallelize: zero micro-batches",
        lambda c: parallelize(c.model, example_inputs=c.inputs, mesh="pp=1", n_microbatches=0), BadArgumentError,
        "got 0", "e.g. n_microbatches=4", "gpt", pg=True),
    Api("parallelize: micro-batches not dividing the batch",
        lambda c: parallelize(c.model, example_inputs=c.inputs, mesh="pp=1", n_microbatches=3), AutoparError,
        "(2, 16)", "pick n_microbatches dividing", "gpt", pg=True),
    Api("parallelize: unknown pipeline schedule",
        lambda c: parallelize(c.model, example_inputs=c.inputs, mesh="pp=1", n_microbatches=2, schedule="zigzag"),
        AutoparError, "'zigzag'", "pick one of gpipe", "gpt", pg=True),
    Api("parallelize: weights path missing",
        lambda c: parallelize(c.model, example_inputs=c.inputs, weights=c.file("nosuch")), WeightsError, "nosuch",
        "save_pretrained directory", "mlp", pg=True),
    Api("parallelize: unknown hardware", lambda c: parallelize(c.model, example_inputs=c.inputs, hardware="tpu-v9"),
        HardwareError, "'tpu-v9'", "autopar calibrate", "mlp", pg=True),
    Api("parallelize: lazy module called with another input shape", lambda c: _lazy_other_shape(c),
        InputSignatureError, "[16, 64] float32", "keep the batch shape fixed", "mlp", pg=True),
    Api("plan: unknown recompute mode", lambda c: autopar.plan(c.model, 2, c.inputs, recompute="some"),
        BadArgumentError, "'some'", "pick one of none, full, auto", "mlp"),
    Api("LAMB: negative learning rate", lambda c: LAMB(c.model.parameters(), lr=-1.0), OptimizerConfigError,
        "lr=-1.0", "pass 0.0 <= lr", "mlp"),
    Api("LARS: momentum of 1 or more", lambda c: LARS(c.model.parameters(), lr=0.1, momentum=2.0),
        OptimizerConfigError, "momentum=2.0", "0.0 <= momentum < 1.0", "mlp"),
    Api("checkpoint.load: no such directory", lambda c: _load_checkpoint(c, c.file("nockpt")), CheckpointError,
        "nockpt", "no checkpoint directory", "mlp", pg=True),
    Api("checkpoint.load: a folder that is not a checkpoint", lambda c: _load_checkpoint(c, c.files), CheckpointError,
        "not an autopar checkpoint", "load an earlier checkpoint", "mlp", pg=True),
    Api("parallelize: model with no parameters", lambda c: parallelize(c.model, example_inputs=c.inputs),
        BadArgumentError, "NoParams", "nn.ModuleList", "noparams", pg=True),
]
