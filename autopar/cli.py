"""The ``autopar`` command line.

    autopar zoo                                   list the model zoo
    autopar trace MODEL [--mesh dp=2,tp=4]        trace a model and print its annotated graph
    autopar validate                              check every sharding rule against the unsharded op
    autopar plan MODEL --gpus N [...]             choose a training plan and print the report
    autopar calibrate --out hw.json               measure this machine; plan with --hardware hw.json
    autopar schedule --gpus 64 --policy all       simulate cluster schedulers on Philly trace workloads
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Sequence

from .errors import AutoparError, BadArgumentError

# Each command imports what it needs inside its function (the planner, the model zoo, the
# scheduler, calibrate): start-up speed, so `autopar --help` or `autopar rules` does not load the
# planner and the cost model. None of these dodges a cycle (tests/test_layers.py checks).

__all__ = ["main", "run"]

# gc.set_threshold's third value: a full collection runs once this many young (generation-1)
# collections passed; a plan makes a few hundred
_NO_FULL_COLLECTIONS = 1_000_000


def _load_model(spec: str, batch_size: int | None, seq_len: int | None, device: str):
    """A zoo name, or ``package.module:factory`` returning (model, example_inputs)."""
    if ":" not in spec:
        from .models import get_model

        return get_model(spec, batch_size=batch_size, seq_len=seq_len, device=device)
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr.isidentifier():
        raise BadArgumentError(f"cannot read model factory {spec!r}; write it as package.module:function, "
                               "e.g. mypkg.models:build")
    factory = getattr(_import_factory_module(module_name, spec), attr, None)
    if not callable(factory):
        raise BadArgumentError(f"module {module_name!r} has no function {attr!r} (from {spec!r}); name a function "
                               "that returns (model, example_inputs)")
    kwargs = {k: v for k, v in (("batch_size", batch_size), ("seq_len", seq_len)) if v is not None}
    try:
        built = factory(**kwargs)
    except Exception as exc:  # the user's code failed: say whose, keep the cause for debugging
        raise BadArgumentError(f"model factory {spec}({', '.join(f'{k}={v}' for k, v in kwargs.items())}) raised "
                               f"{type(exc).__name__}: {exc}; fix the factory (run it in Python to debug it)") from exc
    import torch

    if (not isinstance(built, (tuple, list)) or len(built) != 2 or not isinstance(built[0], torch.nn.Module)
            or not isinstance(built[1], (tuple, list, torch.Tensor))):
        raise BadArgumentError(f"model factory {spec} returned {_fmt_shape(built)[:80]}; it must return "
                               "(model, example_inputs): an nn.Module and a tuple of its forward() inputs")
    return built


def _import_factory_module(module_name: str, spec: str):
    """Import the factory's module from the installed packages or the current directory (a
    console script's path does not hold the current directory; ``python -m`` does)."""
    import importlib
    import os

    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise BadArgumentError(f"cannot import module {module_name!r} for model factory {spec!r}: {exc}; check "
                               "the spelling, and run from the directory holding the package or add it to "
                               "PYTHONPATH") from exc
    finally:
        if added:
            sys.path.remove(cwd)


def _writable(path: str | None, option: str) -> None:
    """Fail before minutes of work, not after, when an output path cannot be written."""
    import os

    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise BadArgumentError(f"{option} {path}: cannot write there (folder {folder!r} does not exist or is not "
                               "writable, or the path is a folder); pick a file path in an existing folder")


def _cmd_zoo(args: argparse.Namespace) -> int:
    from .models import list_models

    print(f"{'name':16s} {'batch':>5s} {'seq':>5s} {'gpus':>5s}  description")
    for entry in list_models():
        seq = "-" if entry.seq_len is None else str(entry.seq_len)
        print(f"{entry.name:16s} {entry.batch_size:5d} {seq:>5s} {entry.gpus:5d}  {entry.description}")
    return 0


def _fmt_shape(val) -> str:
    import torch

    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).replace("torch.", "")
        return f"{dtype}[{','.join(str(s) for s in val.shape)}]"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(_fmt_shape(v) for v in val) + ")"
    return type(val).__name__


def _cmd_trace(args: argparse.Namespace) -> int:
    from . import FALLBACK_KEY, STRATEGIES_KEY, MeshSpec, annotate, trace
    from .passes.rules import op_name

    mesh = MeshSpec.parse(args.mesh)
    t0 = time.perf_counter()
    model, example_inputs = _load_model(args.model, args.batch, args.seq, args.device)
    gm = trace(model, example_inputs)
    t1 = time.perf_counter()
    annotate(gm, mesh)
    t2 = time.perf_counter()
    nodes = list(gm.graph.nodes)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {n_params / 1e6:,.1f}M parameters, {len(nodes)} graph nodes; "
          f"traced in {t1 - t0:.1f} s, annotated for mesh {mesh} in {t2 - t1:.2f} s\n")
    n_attr = sum(1 for n in nodes if n.op == "get_attr")
    if not args.params:
        print(f"({n_attr} parameter/buffer nodes not shown; --params shows them)")
    print(f"{'node':32s} {'op':36s} {'output':26s} {'#strat':>6s}  examples")
    shown = 0
    for node in nodes:
        strategies = node.meta.get(STRATEGIES_KEY)
        if strategies is None or (node.op == "get_attr" and not args.params):
            continue
        if args.limit and shown >= args.limit:
            print("... more nodes not shown (--limit 0 shows all)")
            break
        op = op_name(node.target) if node.op == "call_function" else node.op
        if node.meta.get(FALLBACK_KEY):
            op += " (no rule: replicated)"
        examples = "; ".join(str(s) for s in strategies[: args.examples])
        print(f"{node.name[:32]:32s} {op[:36]:36s} {_fmt_shape(node.meta.get('val'))[:26]:26s} "
              f"{len(strategies):6d}  {examples}")
        shown += 1
    return 0


def _mesh_shape(text: str, whole: str) -> tuple[int, ...]:
    sizes = text.strip().split("x")
    if not all(x.isdigit() and int(x) >= 1 for x in sizes):
        raise BadArgumentError(f"--meshes {whole}: cannot read mesh shape {text!r}; write shapes as sizes joined by "
                               "x, separated by commas, e.g. 2,2x2,2x2x2")
    return tuple(int(x) for x in sizes)


def _cmd_validate(args: argparse.Namespace) -> int:
    from .passes.validate import validate_rules

    shapes = [_mesh_shape(m, args.meshes) for m in args.meshes.split(",")]
    t0 = time.perf_counter()
    report = validate_rules(shapes)
    for failure in report.failures:
        print("FAIL", failure)
    print(f"{report.summary()} on meshes {', '.join(args.meshes.split(','))} in {time.perf_counter() - t0:.0f} s")
    return 1 if report.failures or report.rules_without_samples else 0


def _parse_bytes(text: str) -> float:
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    value = float(m.group(1)) if m else 0.0
    if not m or value <= 0:
        raise BadArgumentError(f"--memory-budget {text}: cannot read a positive memory size; write e.g. 40GB or 512MiB")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    return value * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]


def _offload_option(value: str | None) -> bool | str | list[str]:
    """``--offload`` as ``autopar.plan`` takes it: absent False, bare or ``all`` True, ``auto``, or groups."""
    if value is None:
        return False
    if value in ("all", "auto"):
        return True if value == "all" else "auto"
    return [g.strip() for g in value.split(",") if g.strip()]


def _cmd_plan(args: argparse.Namespace) -> int:
    from .cost_model.hardware import get_hardware
    from .mesh import MeshSpec
    from .planner import STRATEGY_FAMILIES, plan
    from .report import format_report

    # options first: a typo should not cost a model build and a trace
    if args.mesh is not None:
        MeshSpec.parse(args.mesh, args.gpus)
    get_hardware(args.hardware)
    if args.strategy not in STRATEGY_FAMILIES:
        raise BadArgumentError(f"--strategy {args.strategy}: unknown strategy; pick one of {', '.join(STRATEGY_FAMILIES)}")
    budget = _parse_bytes(args.memory_budget) if args.memory_budget is not None else None
    _writable(args.json, "--json")
    _writable(args.html, "--html")
    model, example_inputs = _load_model(args.model, args.batch, args.seq, "meta")
    if getattr(args, "own_process", False):
        # torch's modules, the model and the planner's code live until the process ends: frozen,
        # the cyclic collector's full passes skip them (gpt2 on 8: 0.46 -> 0.28 s of them), here
        # and in the planner's forked helpers. Only where this process is the command's own.
        gc.freeze()
        # No full collections while planning either: each walks every object the trace and the
        # problems made (200-350K on gpt2-xl) and found next to nothing to free (0-64 objects;
        # 17 of them took 1.75 s of gpt2-xl on 64). Young collections still free the search's
        # short-lived cycles; what lives past them stays until the process ends, soon after.
        gen0, gen1, _ = gc.get_threshold()
        gc.set_threshold(gen0, gen1, _NO_FULL_COLLECTIONS)
    result = plan(model, args.gpus, example_inputs, hardware=args.hardware, mesh=args.mesh,
                  strategy=args.strategy, memory_budget_bytes=budget, optimizer=args.optimizer,
                  model_name=args.model, progress=not args.quiet, baselines=not args.no_baselines,
                  recompute=args.recompute, offload=_offload_option(args.offload))
    print(format_report(result))
    if args.json:
        result.to_json(args.json)
        print(f"\nplan written to {args.json}")
    if args.html:
        from .html_report import write_html

        write_html(result, args.html)
        print(f"\nHTML report written to {args.html}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import json

    from .calibrate import calibrate, calibration_to_dict, format_summary

    _writable(args.out, "--out")
    _writable(args.measurements, "--measurements")
    cal = calibrate(args.out, nproc=args.nproc, quick=args.quick, name=args.name, links_from=args.links_from,
                    device=args.device, progress=not args.quiet)
    if cal is None:  # a torchrun rank other than 0
        return 0
    print(format_summary(cal))
    if args.measurements:
        with open(args.measurements, "w", encoding="utf-8") as fh:
            json.dump(calibration_to_dict(cal), fh, indent=1)
        print(f"measurements written to {args.measurements}")
    if args.out:
        print(f"profile written to {args.out}; plan with: autopar plan MODEL --gpus N --hardware {args.out}")
    else:
        print(json.dumps(cal.hardware.to_json(), indent=1))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """The README's main job: plan the default model (gpt2 on 8 A100-80GB) and print the report."""
    ns = argparse.Namespace(model="gpt2", gpus=8, batch=None, seq=None, hardware="a100-80gb", mesh=None,
                            strategy="auto", memory_budget=None, optimizer="adamw", json=None, quiet=False,
                            no_baselines=False, html=None)
    return _cmd_plan(ns)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line naming the fix, not the whole usage block."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _count(minimum: int):
    """An argparse type: an integer >= minimum, with an error that says so."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopar", description="Auto-parallelization for PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("zoo", help="list the model zoo").set_defaults(fn=_cmd_zoo)
    p = sub.add_parser("trace", help="trace a model and print its annotated graph")
    p.add_argument("model", help="zoo name (see `autopar zoo`) or package.module:factory")
    p.add_argument("--batch", type=_count(1), default=None, help="batch size (default: the zoo entry's)")
    p.add_argument("--seq", type=_count(1), default=None, help="sequence length (default: the zoo entry's)")
    p.add_argument("--mesh", default="dp=2,tp=4", help="mesh axes, e.g. dp=2,tp=4 (default)")
    p.add_argument("--device", default="meta", help="device to build zoo models on (default meta: no memory)")
    p.add_argument("--limit", type=_count(0), default=60, help="nodes to print (0: all)")
    p.add_argument("--examples", type=_count(0), default=3, help="strategies to show per node")
    p.add_argument("--params", action="store_true", help="also list parameter and buffer nodes")
    p.set_defaults(fn=_cmd_trace)
    p = sub.add_parser("validate", help="check every sharding rule against the unsharded op")
    p.add_argument("--meshes", default="2,2x2,2x2x2", help="mesh shapes, e.g. 2,2x2,2x2x2 (default)")
    p.set_defaults(fn=_cmd_validate)
    p = sub.add_parser("plan", help="choose a parallel training plan and print the report")
    p.add_argument("model", help="zoo name (see `autopar zoo`) or package.module:factory")
    p.add_argument("--gpus", type=_count(1), required=True, help="number of devices")
    p.add_argument("--batch", type=_count(1), default=None, help="global batch size (default: the zoo entry's)")
    p.add_argument("--seq", type=_count(1), default=None, help="sequence length (default: the zoo entry's)")
    p.add_argument("--hardware", default="a100-80gb", help="profile name or JSON path (default a100-80gb)")
    p.add_argument("--mesh", default=None, help="pin the mesh, e.g. dp=2,tp=4")
    p.add_argument("--strategy", default="auto",
                   help="auto (default), dp, zero2, zero3, megatron, megatron-sp, megatron-dp, 2d, 2.5d, 3d, sp, ulysses, ring, pp (pipeline stages; "
                        "or pin them with --mesh pp=4,dp=2,tp=8)")
    p.add_argument("--memory-budget", default=None, help="per-device budget, e.g. 40GB (default: device memory)")
    p.add_argument("--optimizer", default="adamw",
                   help="adamw (default), adam, sgd, lamb, lars (lamb/lars: prices their norm all-reduces)")
    p.add_argument("--recompute", default="auto", choices=("auto", "none", "full", "selective"),
                   help="activation recompute of repeated blocks: the planner's choice (auto, default), "
                        "none, every block (full), or each block's attention (selective)")
    p.add_argument("--offload", nargs="?", const="all", default=None, metavar="all|auto|GROUPS",
                   help="ZeRO-Offload: optimizer state and fp32 master weights in host memory, the step on the host "
                        "CPU; every parameter (all, the default of a bare --offload), only the groups the budget "
                        "needs (auto), or comma-separated groups (blocks.*.mlp.fc_in.weight,...)")
    p.add_argument("--json", default=None, help="write the plan as JSON to this path")
    p.add_argument("--html", default=None, help="also write a self-contained HTML report (inline SVG plots) here")
    p.add_argument("--no-baselines", action="store_true", help="skip pricing the baselines")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(fn=_cmd_plan, quick_exit=True)
    p = sub.add_parser("calibrate", help="measure this machine and write a hardware profile (JSON)",
                       description="Measure matmul rate, memory bandwidth, kernel overhead and collective "
                                   "latency/bandwidth on local ranks (or under torchrun) and write a profile "
                                   "that `autopar plan --hardware PATH` reads.")
    p.add_argument("--out", default=None, help="write the profile JSON here (default: print it)")
    p.add_argument("--nproc", type=_count(1), default=None,
                   help="local ranks to spawn when not under torchrun (default: CUDA devices, or 4 on CPU)")
    p.add_argument("--quick", action="store_true", help="fewer sizes, shorter timing windows (rougher; for tests)")
    p.add_argument("--name", default=None, help="profile name (default calibrated-<device>)")
    p.add_argument("--links-from", default=None, help="copy links from this profile instead of measuring "
                                                      "(needed with --nproc 1)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="what to measure (default auto)")
    p.add_argument("--measurements", default=None, help="also write every raw measurement as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(fn=_cmd_calibrate)
    sub.add_parser("demo", help="the README main job").set_defaults(fn=_cmd_demo)
    # --- autopar schedule: the cluster scheduler (autopar/scheduler/cli.py) ---
    from .scheduler import cli as schedule_cli

    p = sub.add_parser("schedule", help="simulate cluster schedulers (ONES, Tiresias, Optimus, Pollux, FIFO) on trace jobs")
    schedule_cli.add_arguments(p)
    p.set_defaults(fn=schedule_cli.run)
    return parser


def main(argv: Sequence[str] | None = None, own_process: bool = False, done: dict | None = None) -> int:
    """Run one command; ``own_process``: the process ends after it (``run``), so a command may
    tune the process's garbage collector for its own speed (a caller's process is left alone).
    ``done`` (``run``'s) gets ``quick_exit``: the command leaves nothing for the interpreter's
    shutdown to finish."""
    args = build_parser().parse_args(argv)
    args.own_process = own_process
    if done is not None:
        done["quick_exit"] = getattr(args, "quick_exit", False)
    try:
        return args.fn(args)
    except (AutoparError, KeyError, ValueError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"autopar: error: {message}", file=sys.stderr)
        return 2


def run() -> None:
    """The process entry point (the ``autopar`` script, ``python -m autopar[.cli]``): ``main``,
    then exit. Everything left is frozen first: the interpreter's collections at exit would
    otherwise walk torch's and the plan's objects once more (0.6 s of `autopar plan gpt2 --gpus 8`)."""
    # autopar's import (torch's) left ~270K objects uncollected (autopar/__init__.py): frozen at
    # once, before the young collections would walk them all up the generations (0.4 s of
    # `autopar plan gpt2 --gpus 8`); they live until the process ends anyway
    gc.freeze()
    done: dict = {}
    code = main(own_process=True, done=done)
    sys.stdout.flush()
    sys.stderr.flush()
    if done.get("quick_exit"):
        # `autopar plan` has written and closed its files and reaped its forked helpers: the
        # interpreter's shutdown would only tear torch's modules down (0.23-0.31 s of
        # `autopar plan gpt2 --gpus 8`), so the process ends here
        os._exit(code)
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
