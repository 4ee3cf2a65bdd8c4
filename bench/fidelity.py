"""Does the cost model rank plans the way they run? Predicted vs measured step time and peak
memory of many autopar plans of one GPT, timed round-robin in ONE launch of 4 CPU ranks.

    python bench/fidelity.py                      # calibrates first (~1 min), then ~5 min
    python bench/fidelity.py --hardware hw.json   # an existing profile (autopar calibrate --out)
    python bench/fidelity.py --quick              # tiny model, 2 rounds: a smoke run

Every plan (families, meshes, a recompute variant, pipelines and the planner's own pick with
its baselines) is planned on rank 0 with the profile, set up on every rank, warmed up (the
last warm-up step under the live-tensor tracker, ``bench/memtrack.py``: peak bytes per rank)
and then timed in rounds: each round runs one step of every plan in turn, a barrier before
and after each step, so load swings of a shared machine hit all plans alike; the median over
rounds is the plan's step time.

Oversubscription: 4 ranks share the machine's 2 cores, each pinned to one core (2 ranks per
core, ``autopar.calibrate_measure.pin_to_core``). The profile is measured the same way (``autopar calibrate`` runs 4 ranks at once, each measuring its share),
so the cost model prices the oversubscribed machine; the profile's compute efficiency is fitted
there too, to a reference step of another, smaller GPT (``autopar/calibrate_reference.py``),
never to these plans.

Prints the per-plan table and the fidelity figures (Spearman of predicted vs measured step
time, median |measured/predicted - 1|, peak memory ratios, the planner's pick vs every
baseline it was predicted to beat); every figure goes to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

WORLD = 4
# (name, how it is planned): plan(**options), or a pinned pipeline (pp, micro-batches, schedule)
PLANS: list[tuple[str, dict]] = [
    ("dp", dict(strategy="dp")),
    ("zero2", dict(strategy="zero2")),
    ("zero3", dict(strategy="zero3")),
    ("dp+recompute", dict(strategy="dp", recompute="full")),
    ("megatron", dict(strategy="megatron")),
    ("megatron-sp", dict(strategy="megatron-sp")),
    ("megatron-dp", dict(strategy="megatron-dp")),
    ("2d", dict(strategy="2d")),
    ("pp2xdp2", dict(pipeline=dict(pp=2, n_microbatches=4, schedule="1f1b"))),
    ("pp4", dict(pipeline=dict(pp=4, n_microbatches=4, schedule="1f1b"))),
    ("auto", dict(strategy="auto", baselines=True)),
]


def make_plan(model, inputs, hardware: str, options: dict):
    from autopar.pipeline_stages import hand_pipeline_plan
    from autopar.planner import plan

    common = dict(hardware=hardware, mixed_precision=False)
    if "pipeline" in options:
        pipe = options["pipeline"]
        return hand_pipeline_plan(model, inputs, WORLD, pp=pipe["pp"], n_microbatches=pipe["n_microbatches"],
                                  schedule=pipe["schedule"], stage_mesh=None, stage_blocks=None, virtual_stages=1,
                                  plan_fn=plan, baselines=False, **common)
    return plan(model, WORLD, inputs, baselines=options.get("baselines", False), time_limit_s=30,
                **common, **{k: v for k, v in options.items() if k != "baselines"})


def _plans_on_rank0(shape, hardware: str, names: list[str]) -> list[str | None]:
    """Every plan's JSON made on rank 0 and broadcast (None: that plan failed; its error is logged)."""
    from runtime_vs_baselines import build_model

    texts: list[str | None] = []
    if dist.get_rank() == 0:
        for name, options in PLANS:
            if name not in names:
                continue
            model, inputs = build_model(shape)
            t0 = time.perf_counter()
            try:
                texts.append(make_plan(model, inputs, hardware, options).to_json())
                print(f"[fidelity] planned {name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            except Exception as exc:  # a plan that cannot be made is a result too
                texts.append(None)
                print(f"[fidelity] {name}: planning failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    box = [texts]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _train_step(module, opt, inputs) -> tuple[torch.Tensor, dict]:
    from autopar.runtime import count_bytes

    with count_bytes() as sent:
        if hasattr(module, "step") and hasattr(module, "stage_ids"):  # a pipeline: the schedule runs backward
            loss = module.step(*inputs)
        else:
            loss = module(*inputs)
            loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, dict(sent)


def _say(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"[fidelity] {message}", file=sys.stderr, flush=True)


def _predicted(plan) -> dict:
    return dict(mesh=str(plan.mesh), predicted_step_s=plan.step_seconds,
                predicted_compute_s=plan.compute_seconds, predicted_comm_s=plan.comm_seconds,
                predicted_peak_bytes=plan.peak_memory_bytes_per_device, predicted_comm_bytes=dict(plan.comm_bytes),
                pipeline=None if plan.pipeline is None else dict(n_stages=plan.pipeline.n_stages,
                                                                  n_microbatches=plan.pipeline.n_microbatches),
                baselines=[dict(name=b.name, mesh=b.mesh, step_seconds=b.step_seconds, feasible=b.feasible)
                           for b in plan.baselines])


def _rank(rank: int, port: int, names: list[str], quick: bool, hardware: str, rounds: int, out: str) -> None:
    from memtrack import LiveBytes, bucket_buffers, optimizer_tensors
    from runtime_vs_baselines import FULL, QUICK, build_model

    from autopar.calibrate_measure import pin_to_core
    from autopar.calibrate_reference import reference_model
    from autopar.plan import Plan
    from autopar.runtime.offload import make_optimizer
    from autopar.runtime.parallel_module import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    pin_to_core(rank, WORLD)  # 2 ranks per core, as `autopar calibrate` measured them
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    shape = QUICK if quick else FULL
    chosen = [n for n, _ in PLANS if n in names]
    texts = _plans_on_rank0(shape, hardware, names)
    runs, records = {}, {}
    for name, text in zip(chosen, texts):
        if text is None:
            records[name] = dict(plan=name, ok=False, error="planning failed (see the log)")
            continue
        the_plan = Plan.from_json(text)
        model, inputs = build_model(shape)
        try:
            module = parallelize(model, example_inputs=inputs, plan=the_plan, hardware=hardware,
                                 mixed_precision=False)
            # the optimizer autopar's plan prices (torch's fused AdamW: no step temporaries); the
            # loop AdamW adds two temporaries of the largest parameter (16 MiB here, bench/memwhere.py)
            opt = make_optimizer(module, lr=1e-3)
            with LiveBytes() as mem:
                for i in range(shape.warmup):
                    mem.track(optimizer_tensors(module, opt) + bucket_buffers(module))
                    if i == shape.warmup - 1:
                        mem.reset_peak()
                    _train_step(module, opt, inputs)
            runs[name] = (module, opt, inputs)
            records[name] = dict(plan=name, ok=True, peak_bytes=mem.peak_bytes, **_predicted(the_plan))
            _say(f"{name}: set up and warmed up")
        except Exception as exc:  # every rank fails alike (same plan, same code): record and go on
            records[name] = dict(plan=name, ok=False, error=f"{type(exc).__name__}: {exc}",
                                 traceback=traceback.format_exc()[-2000:])
        dist.barrier()
    # calibrate's reference step (not a plan: no figure counts it) in the same rounds, each rank
    # alone as calibrate timed it: did the machine run as fast in the rounds as at calibration?
    ref_model, ref_inputs = reference_model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, fused=True)
    for _ in range(2):
        _train_step(ref_model, ref_opt, ref_inputs)
    times: dict[str, list[float]] = {n: [] for n in runs}
    ref_times: list[float] = []
    sent: dict[str, dict] = {}
    for k in range(rounds):
        _say(f"round {k + 1} of {rounds}")
        for name, (module, opt, inputs) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            _, sent[name] = _train_step(module, opt, inputs)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        _train_step(ref_model, ref_opt, ref_inputs)
        ref_times.append(time.perf_counter() - t0)
    mine_ref = [None] * WORLD
    dist.all_gather_object(mine_ref, statistics.median(ref_times))
    mine = {n: dict(peak=r.get("peak_bytes"), sent=sent.get(n)) for n, r in records.items()}
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        for name, r in records.items():
            if r["ok"]:
                r.update(step_s=times[name], measured_step_s=statistics.median(times[name]),
                         peak_bytes_per_rank=[e[name]["peak"] for e in everyone],
                         sent_per_rank=[e[name]["sent"] for e in everyone])
                r.pop("peak_bytes")
        # like calibrate: the median over ranks of each rank's median step
        reference = dict(measured_step_s=statistics.median(mine_ref), per_rank_s=mine_ref)
        with open(out, "w") as f:
            json.dump(dict(records=[records[n] for n in chosen], reference=reference), f, indent=1, default=str)
    dist.destroy_process_group()


def calibrated_profile(out_dir: str) -> str:
    """``autopar calibrate`` with 4 ranks now, on this machine as it is loaded now."""
    path = os.path.join(out_dir, "cpu-calibrated.json")
    cmd = [sys.executable, "-m", "autopar.cli", "calibrate", "--out", path, "--nproc", str(WORLD)]
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=sys.stderr)
    return path


def run(names: list[str], quick: bool, hardware: str, rounds: int) -> tuple[list[dict], dict]:
    """(per-plan records, calibrate's reference step as timed in the same rounds)."""
    import tempfile

    import torch.multiprocessing as mp
    from runtime_vs_baselines import _free_port

    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fidelity.json")
        mp.spawn(_rank, args=(_free_port(), names, quick, hardware, rounds, out), nprocs=WORLD)
        with open(out) as f:
            got = json.load(f)
        return got["records"], got["reference"]


def reference_drift(hardware: str, reference: dict) -> dict:
    """Calibrate's reference step priced with the profile (= what calibrate measured: the
    profile's efficiency is fitted to it) against the same step timed in the bench's rounds. A
    ratio away from 1 is the machine running at another speed than at calibration, which every
    plan's ratio carries too."""
    from autopar.calibrate_reference import reference_model
    from autopar.cost_model.hardware import get_hardware
    from autopar.planner import plan

    model, inputs = reference_model("meta")
    predicted = plan(model, 1, inputs, hardware=get_hardware(hardware), strategy="dp", mixed_precision=False,
                     baselines=False, pipeline=False, recompute="none").step_seconds
    return dict(reference, predicted_step_s=predicted, ratio=reference["measured_step_s"] / predicted)


def print_drift(drift: dict) -> None:
    print(f"calibrate's reference step (not a plan), timed in the same rounds: {drift['measured_step_s'] * 1e3:.1f} ms "
          f"vs {drift['predicted_step_s'] * 1e3:.1f} ms priced (= as calibrated): {drift['ratio']:.2f}x; a ratio "
          "away from 1 is the machine's speed since calibration, in every plan's ratio too")


def main() -> None:
    from fidelity_tables import plan_fidelity, print_plan_fidelity

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", nargs="+", default=[n for n, _ in PLANS], choices=[n for n, _ in PLANS])
    ap.add_argument("--hardware", default="calibrate", help="'calibrate' (measure now), a profile name or JSON path")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 11, --quick 2)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "fidelity.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    hardware = calibrated_profile(os.path.dirname(os.path.abspath(args.json))) if args.hardware == "calibrate" \
        else args.hardware
    load0 = os.getloadavg()
    if args.quick and "pp4" in args.plans:  # the quick model has 2 blocks: no 4 stages
        args.plans.remove("pp4")
    records, reference = run(args.plans, args.quick, hardware, args.rounds or (2 if args.quick else 11))
    figures = plan_fidelity(records)
    print_plan_fidelity(records, figures, hardware)
    drift = reference_drift(hardware, reference)
    print_drift(drift)
    # The same predictions with the profile's speed re-fitted to the reference step as timed in
    # these rounds (what calibrating during the rounds would give; the reference is not a plan,
    # so no plan's time enters it): the step error the machine's drift leaves out. Reported
    # beside the figure above, never instead of it.
    ok = [r for r in records if r.get("ok")]
    if ok and drift["ratio"] > 0:
        figures["median_abs_step_error_refit"] = statistics.median(
            abs(r["measured_step_s"] / (r["predicted_step_s"] * drift["ratio"]) - 1) for r in ok)
        print(f"median |measured/predicted - 1| step time with the profile's speed re-fitted to the reference step "
              f"timed in these rounds (x{drift['ratio']:.2f}): {figures['median_abs_step_error_refit']:.0%} "
              "(beside the figure above, not instead of it)")
    wall = time.perf_counter() - t0
    print(f"wall time {wall:.0f} s; 1-min load average {load0[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
          f"({os.cpu_count()} CPUs; 4 ranks = 2 per core when the machine is otherwise idle)")
    with open(args.json, "w") as f:
        json.dump(dict(hardware=hardware, profile=json.load(open(hardware)) if os.path.isfile(hardware) else hardware,
                       records=records, figures=figures, reference_drift=drift, wall_s=wall, load_start=load0, load_end=os.getloadavg()),
                  f, indent=1, default=str)


if __name__ == "__main__":
    main()
