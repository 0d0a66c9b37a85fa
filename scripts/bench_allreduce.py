"""All-reduce and gather latency of CPU ranks on one host: the shared-memory segment against gloo's TCP loopback.

    python scripts/bench_allreduce.py                       # tp 2, the issue's three shapes
    python scripts/bench_allreduce.py --tp 4 --iters 2000

Starts `--tp` processes that join one gloo group as neuron's ranks do (a rendezvous store on
loopback), then time `--iters` all-reduces of each shape through each backend, one backend after the
other in the same processes, after `--warmup` untimed ones. Each rank sets torch to one thread
per rank's share of the cores, as the workers do. Prints the median and the 90th percentile per call
in microseconds, as rank 0 measured them, and the ratio gloo / shm. Then the same for the gather to
rank 0 of GATHERS (a step's logits split over the vocabulary: one sequence's and 16 sequences' halves
of a 32,000-token vocabulary at tp 2).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

SHAPES = ((1, 1024), (16, 1024), (512, 4096))
GATHERS = ((1, 16000), (16, 16000))


def rank_main(rank: int, world: int, address: str, args: dict, out) -> None:
    from neuron.distributed.comm import GlooCommunicator, Rendezvous, host_store, make_store
    from neuron.distributed.shm import ShmCommunicator

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = host_store(world, 60.0) if rank == 0 else None
    if rank == 0:
        out.put(f"{store.host}:{store.port}")
    else:
        store = make_store(address, world, 60.0)
    rendezvous = Rendezvous(store, 60.0)
    gloo = GlooCommunicator(rank, world, rendezvous, 60.0)
    shm = ShmCommunicator.join(gloo, rendezvous, 60.0)
    assert shm.backend == "shm", "the shared-memory all-reduce did not start"
    results = {}
    for shape in SHAPES:
        x = torch.randn(*shape)
        for name, comm in (("gloo", gloo), ("shm", shm)):
            for _ in range(args["warmup"]):
                comm.all_reduce(x.clone())
            times = []
            y = x.clone()
            for _ in range(args["iters"] if shape[0] * shape[1] < 2**20 else max(args["iters"] // 20, 20)):
                t0 = time.perf_counter_ns()
                comm.all_reduce(y)
                times.append(time.perf_counter_ns() - t0)
            times.sort()
            results[f"{name} {shape[0]}x{shape[1]}"] = (statistics.median(times) / 1000,
                                                         times[int(0.9 * (len(times) - 1))] / 1000)
    for shape in GATHERS:
        x = torch.randn(*shape)
        for name, comm in (("gloo", gloo), ("shm", shm)):
            for _ in range(args["warmup"]):
                comm.gather_to_rank0(x)
            comm.all_reduce(torch.zeros(1))  # every rank starts the timed gathers together
            times = []
            for _ in range(args["iters"]):
                t0 = time.perf_counter_ns()
                comm.gather_to_rank0(x)
                times.append(time.perf_counter_ns() - t0)
            times.sort()
            results[f"{name} gather {shape[0]}x{shape[1]}"] = (statistics.median(times) / 1000,
                                                                times[int(0.9 * (len(times) - 1))] / 1000)
    if rank == 0:
        out.put(results)
    shm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    opts = {"iters": args.iters, "warmup": args.warmup}
    first = ctx.Process(target=rank_main, args=(0, args.tp, "", opts, out))
    first.start()
    address = out.get(timeout=60)
    rest = [ctx.Process(target=rank_main, args=(r, args.tp, address, opts, out)) for r in range(1, args.tp)]
    for proc in rest:
        proc.start()
    results = out.get(timeout=600)
    for proc in [first, *rest]:
        proc.join(60)
    print(f"all-reduce at tp {args.tp}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; "
          "microseconds per call, median / p90")
    print(f"{'shape (fp32)':>14} {'gloo':>18} {'shm':>18} {'gloo / shm':>11}")
    for shape in SHAPES:
        key = f"{shape[0]}x{shape[1]}"
        g, s = results[f"gloo {key}"], results[f"shm {key}"]
        print(f"{key:>14} {g[0]:9.1f} / {g[1]:6.1f} {s[0]:9.1f} / {s[1]:6.1f} {g[0] / s[0]:10.1f}x")
    print(f"{'gather (fp32)':>14}")
    for shape in GATHERS:
        key = f"{shape[0]}x{shape[1]}"
        g, s = results[f"gloo gather {key}"], results[f"shm gather {key}"]
        print(f"{key:>14} {g[0]:9.1f} / {g[1]:6.1f} {s[0]:9.1f} / {s[1]:6.1f} {g[0] / s[0]:10.1f}x")
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(json.dumps({"tp": args.tp, "load": os.getloadavg()[0], "results": results}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
