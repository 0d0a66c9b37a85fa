"""Where a batch-1 decode step's time goes: the host's Python (cProfile) and the device's kernels
(torch.profiler), on a random-weight checkpoint in a published Qwen3 shape.

    python scripts/profile_gpu_decode.py --out prof            # 0.6B, paged attention, on cuda
    python scripts/profile_gpu_decode.py --shape tiny --device cpu --tokens 32 --out prof

Prints tok/s, then: the device's busy time per token against the wall time per token (a step whose
kernels take a fraction of its wall time is bound by the host), the top functions by own time and by
cumulative time under cProfile, and the top operators under torch.profiler. Writes the full cProfile
stats and a Chrome trace of a few steps to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench.checkpoints import build_checkpoint, qwen3_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.6b", choices=("0.6b", "8b", "tiny"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention", default="paged", choices=("paged", "gather"))
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per timed generate (default: %(default)s)")
    ap.add_argument("--trace-tokens", type=int, default=24, help="new tokens in the Chrome trace")
    ap.add_argument("--out", type=Path, default=Path("profile_gpu_decode"))
    ap.add_argument("--ckpt", type=Path, help="the checkpoint's directory (default: under --out)")
    args = ap.parse_args()

    os.environ["NEURON_ATTENTION"] = args.attention
    import torch

    from neuron import LLM, SamplingParams

    args.out.mkdir(parents=True, exist_ok=True)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    ckpt = args.ckpt or args.out / f"ckpt-{args.shape}"
    if not (ckpt / "config.json").is_file():
        t0 = time.perf_counter()
        build_checkpoint(ckpt, qwen3_config(args.shape, dtype), args.device, 8 << 30)
        print(f"checkpoint {args.shape} built in {time.perf_counter() - t0:.1f} s", flush=True)

    prompt = [(7 * i + 3) % 1000 for i in range(args.prompt)]
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with LLM(str(ckpt), device=args.device, dtype=dtype, max_num_seqs=1,
             max_model_len=args.prompt + args.tokens + 8) as llm:
        def generate(n: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            sync()
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt}], params)
            sync()
            got = len(out[0].outputs[0].token_ids)
            if got != n:
                raise RuntimeError(f"generated {got} tokens, expected {n}")
            return time.perf_counter() - t0

        generate(8)
        generate(args.tokens)
        runs = [generate(args.tokens) for _ in range(3)]
        best = min(runs)
        print(f"decode: {args.tokens / best:.1f} tok/s best of 3 ({1e3 * best / args.tokens:.3f} ms a token, "
              f"prefill included); runs {[round(r, 3) for r in runs]}", flush=True)
        # The prefill alone, so the decode's own time per token can be separated from it.
        first = min(generate(1) for _ in range(3))
        per_token = (best - first) / (args.tokens - 1)
        print(f"prefill + first token: {1e3 * first:.2f} ms; decode alone {1e3 * per_token:.3f} ms a token "
              f"({1 / per_token:.1f} tok/s)", flush=True)

        prof = cProfile.Profile()
        prof.enable()
        seconds = generate(args.tokens)
        prof.disable()
        prof.dump_stats(str(args.out / "decode.pstats"))
        print(f"\ncProfile over one generate of {args.tokens} tokens: {seconds:.3f} s (profiled)")
        for key in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
            body = text.getvalue()
            print(f"--- by {key} ---\n" + body[body.find("ncalls"):], flush=True)

        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as tp:
            seconds = generate(args.trace_tokens)
        tp.export_chrome_trace(str(args.out / "decode_trace.json"))
        events = tp.key_averages()
        device_us = sum(e.self_device_time_total for e in events) if cuda else 0.0
        print(f"\ntorch.profiler over one generate of {args.trace_tokens} tokens: {seconds:.3f} s wall; "
              f"device busy {device_us / 1e3:.2f} ms ({device_us / 1e3 / args.trace_tokens:.3f} ms a token, "
              f"{100 * device_us / 1e6 / seconds:.0f} % of the wall time)")
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        print(events.table(sort_by=sort, row_limit=30, max_name_column_width=70))
        print(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
