"""Peak parameter bytes per rank while loading and training: a whole model per rank vs shards only.

Two launches of 4 gloo ranks each train a Llama built from a config and saved with
``save_pretrained`` (safetensors), under one plan family:

* ``whole``: the path before ``weights=``: every rank builds the model on CPU and loads the whole
  checkpoint (``from_pretrained``), then ``parallelize(model, example_kwargs=...)`` broadcasts and
  cuts it; the user's whole model stays alive next to the shards;
* ``shards``: ``with torch.device("meta")`` model + ``parallelize(model, weights=dir)``: each
  rank reads only its slices (safetensors ``get_slice``); the model never exists whole.

Per rank it prints: the most parameter bytes held at once while loading (the shard source's
count of its pieces and temporaries, plus the user's whole model where it exists), the parameter
bytes resident during training (distinct storages of every parameter reachable), the peak of all
live tensor bytes in a training step (bench/memtrack.LiveBytes: activations and ZeRO-3 gathers
included), and the process's RSS high-water mark growth from before the model was made (an
independent OS figure, which includes libraries' and the tracer's own allocations).

    python bench/load_memory.py [--strategy zero3] [--hidden 512] [--layers 4] [--vocab 8000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))


def _config(args):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=args["hidden"], intermediate_size=args["hidden"] * 11 // 4,
                       num_hidden_layers=args["layers"], num_attention_heads=8, num_key_value_heads=8,
                       vocab_size=args["vocab"], max_position_embeddings=128, use_cache=False,
                       attn_implementation="sdpa", tie_word_embeddings=False)


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _param_bytes(*modules) -> int:
    seen = {}
    for m in modules:
        for p in m.parameters():
            if p.device.type != "meta":
                seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def _rank(rank: int, world: int, port: int, mode: str, args: dict, out: str) -> None:
    from memtrack import LiveBytes

    import autopar
    from transformers import LlamaForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ids = torch.randint(0, args["vocab"], (8, 32), generator=torch.Generator().manual_seed(0))
    kwargs = dict(input_ids=ids, labels=ids)
    options = dict(strategy=args["strategy"], baselines=False)
    rss0 = _rss_bytes()
    if mode == "whole":
        user = LlamaForCausalLM.from_pretrained(args["dir"])
        model = autopar.parallelize(user, example_kwargs=kwargs, **options)
        pm = model
        load_peak = _param_bytes(user) + pm.shard_source_peak_bytes
    else:
        with torch.device("meta"):
            user = LlamaForCausalLM(_config(args))
        model = autopar.parallelize(user, example_kwargs=kwargs, weights=args["dir"], **options)
        pm = model  # (the lazy parallelize(user, weights=...) builds the same on its first call)
        load_peak = pm.shard_source_peak_bytes
    rss_load = _rss_bytes()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(**kwargs).loss.backward()
    opt.step()
    opt.zero_grad()
    with LiveBytes() as mem:
        mem.track([p for p in (*user.parameters(), *pm.parameters()) if p.device.type != "meta"])
        mem.track(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
        model(**kwargs).loss.backward()
        opt.step()
        opt.zero_grad()
    shard = sum(s.tensor.nbytes for s in pm.shards() if s.is_param and s.tied_to is None)
    row = dict(rank=rank, load_peak=load_peak, resident=_param_bytes(user, pm), step_peak=mem.peak_bytes,
               shard=shard, rss_growth=rss_load - rss0, mesh=str(pm.plan.mesh), hardware=pm.plan.hardware)
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(rows, fh)
    dist.destroy_process_group()


def main() -> None:
    import socket
    import subprocess

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="zero3")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--world", type=int, default=4)
    a = ap.parse_args()
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        args = dict(vars(a), dir=os.path.join(tmp, "llama"))
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config(args))
        model.save_pretrained(args["dir"])
        whole = sum(p.nbytes for p in model.parameters())
        largest = max(p.nbytes for p in model.parameters())
        del model
        results = {}
        for mode in ("whole", "shards"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            out = os.path.join(tmp, f"{mode}.json")
            env = dict(os.environ, OMP_NUM_THREADS="1")
            subprocess.run([sys.executable, __file__, "--_rank", mode, str(port), json.dumps(args), out],
                           check=True, env=env)
            with open(out) as fh:
                results[mode] = json.load(fh)
    mib = lambda b: f"{b / 2**20:8.2f}"  # noqa: E731
    print(f"Llama hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}: whole model {mib(whole)} MiB, largest tensor "
          f"{mib(largest)} MiB; {a.world} gloo ranks, strategy {a.strategy} (mesh {results['shards'][0]['mesh']}, "
          f"hardware {results['shards'][0]['hardware']})")
    print("path    rank  shard MiB  load peak MiB  (<= shard+largest?)  resident params MiB  step peak MiB  "
          "RSS growth MiB")
    for mode in ("whole", "shards"):
        for r in results[mode]:
            ok = r["load_peak"] <= r["shard"] + largest
            print(f"{mode:7s} {r['rank']:4d}  {mib(r['shard'])}  {mib(r['load_peak'])}       {str(ok):5s}            "
                  f"{mib(r['resident'])}        {mib(r['step_peak'])}      {mib(r['rss_growth'])}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_rank":
        import torch.multiprocessing as mp

        mode, port, args, out = sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
        mp.spawn(_rank, args=(int(args["world"]), port, mode, args, out), nprocs=int(args["world"]))
    else:
        main()
