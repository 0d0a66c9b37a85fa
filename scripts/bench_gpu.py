"""One GPU benchmark, run as is: neuron against transformers and against the memory bandwidth, on
random-weight checkpoints in the published Qwen3-0.6B and Qwen3-8B shapes, all in one run.

    python scripts/bench_gpu.py                                   # everything, both shapes, on cuda
    python scripts/bench_gpu.py --shapes 0.6b --only decode,serve --out run.json --md run.md
    python scripts/bench_gpu.py --tiny --device cpu               # the plumbing, on CPU, in about a minute

Parts (--only): decode (device copy bandwidth and the batch-1 decode limit it implies; transformers
eager and static-cache compiled `generate`; neuron), offline (64 prompts of 100-1024 tokens, 256
new tokens each, against transformers with one padded batch; 256 prompts with input and output
lengths in 100-1024, neuron only), tp2 (neuron tp=2 on one GPU at batch 1, 0.6B), serve (`neuron
serve` on the 0.6B checkpoint driven by `neuron bench` at concurrency 1, 8, 32, 64).

neuron runs once per attention path (--attention; both by default): `gather` copies each context
out of the KV pool for SDPA, `paged` reads blocks in place with the Triton kernel and replays
decode steps from CUDA graphs where the step allows. The serve part uses the path whose offline (a)
figure was higher, so the default for `neuron serve` can be chosen from one run.

Weights are drawn on the device (randn * 0.02, norms at 1) and written as safetensors; there is no
tokenizer, so every prompt is token ids and every run ignores EOS. Each measurement runs in a fresh
Python process (this script with `_child`), so one model's memory cannot skew the next, under a
deadline; a part that fails is reported as "failed: reason" and the rest goes on. Prints a markdown
table, writes it to --md and the same figures as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

# gpu_bench sits beside this script, whose directory Python puts first on sys.path.
from gpu_bench.checkpoints import SHAPES, weights_read_per_token
from gpu_bench.children import child_main
from gpu_bench.environment import host_environment
from gpu_bench.processes import ChildRun, run_child
from gpu_bench.report import (
    BATCH1,
    HF_EAGER,
    HF_STATIC,
    LIMIT,
    NEURON,
    OFFLINE_A,
    OFFLINE_B,
    Row,
    add_ratios,
    find,
    fmt_count,
    markdown,
)
from gpu_bench.serving import ServeRun, serve_row
from gpu_bench.workloads import FULL, TINY, Workload, Workloads

PARTS = ("decode", "offline", "tp2", "serve")
ATTENTION = ("gather", "paged")


class Bench:
    def __init__(self, args: argparse.Namespace, wl: Workloads, work: Path, ckpt_root: Path):
        self.args, self.wl, self.work, self.ckpt_root = args, wl, work, ckpt_root
        self.shapes = ["tiny"] if args.tiny else args.shapes
        self.small = "tiny" if args.tiny else "0.6b"  # the shape of tp2 and serve
        self.device, self.dtype = args.device, "bfloat16"
        self.env: dict = {}
        self.rows: list[Row] = []
        self.unbuilt: dict[str, str] = {}  # shape -> why it has no checkpoint
        self.decode_load = Workload.drawn(1, (wl.decode_prompt,) * 2, (wl.decode_tokens,) * 2, seed=0)
        self.offline_a = Workload.drawn(*wl.offline_a, seed=1)
        self.offline_b = Workload.drawn(*wl.offline_b, seed=2)

    def run(self) -> None:
        self.prepare()
        for shape in self.shapes:
            if {"decode", "offline"} & self.args.only:
                self.transformers(shape)
            for mode in self.args.attention:
                if "decode" in self.args.only:
                    self.neuron(shape, "decode", BATCH1, self.decode_load, 1, mode)
                if "offline" in self.args.only:
                    self.neuron(shape, "offline", OFFLINE_A, self.offline_a, 1, mode)
                    self.neuron(shape, "offline", OFFLINE_B, self.offline_b, 1, mode)
        if "tp2" in self.args.only:
            for mode in self.args.attention:
                self.neuron(self.small, "tp2", BATCH1, self.decode_load, 2, mode)
        mode = self.serve_attention()
        if "serve" in self.args.only:
            self.serve(mode)
        add_ratios(self.rows, self.small, self.wl.serve_concurrency[-1], neuron_engine(mode))

    def needed_shapes(self) -> list[str]:
        extra = [self.small] if {"tp2", "serve"} & self.args.only and self.small not in self.shapes else []
        return self.shapes + extra

    def child(self, kind: str, label: str, spec: dict, shape: str | None = None) -> ChildRun:
        if shape in self.unbuilt:
            return ChildRun({}, f"no {shape} checkpoint ({self.unbuilt[shape]})")
        return run_child(kind, label, spec, self.work, self.args.deadline)

    def add(self, run: ChildRun, name: str, part: str, shape: str, engine: str, figure: str, unit: str,
            note: str = "") -> Row:
        value, detail, error = run.get(name)
        row = Row(part, shape, engine, figure, unit, value, f"failed: {error}" if error else None, note,
                  detail=detail)
        self.rows.append(row)
        return row

    def prepare(self) -> None:
        paths = {s: str(self.ckpt_root / s) for s in self.needed_shapes()}
        spec = {"device": self.device, "copy_bytes": self.wl.copy_bytes, "shard_bytes": self.wl.shard_bytes,
                "checkpoints": paths}
        run = self.child("prepare", "prepare", spec)
        _, env, error = run.get("env")
        if error:
            self.env["device"] = f"{self.device} (failed: {error})"
        else:
            self.env.update(env)
            self.device, self.dtype = env["device"], env["dtype"]
        copy = self.add(run, "bandwidth", "bandwidth", "-", "device", "device-to-device copy", "GB/s",
                        f"{self.wl.copy_bytes >> 20} MiB copied; bytes read + written / time")
        for shape in paths:
            built = self.add(run, f"build:{shape}", "checkpoint", shape, "-", "random weights drawn on device", "s")
            if built.error:
                self.unbuilt[shape] = built.error.removeprefix("failed: ")
            params, per_token = weights_read_per_token(shape, 2 if self.dtype == "bfloat16" else 4)
            built.note = f"{fmt_count(params)} params, {self.dtype}"
            if "files" in built.detail:
                built.note += f", {built.detail['files']} safetensors file(s)"
            limit = Row("bandwidth", shape, LIMIT, BATCH1, "tok/s",
                        note=f"copy bandwidth / {fmt_count(per_token)}B of weights read per token")
            if copy.value:
                limit.value = copy.value * 1e9 / per_token
            else:
                limit.error = "failed: no bandwidth figure"
            self.rows.append(limit)

    def transformers(self, shape: str) -> None:
        spec = {"path": str(self.ckpt_root / shape), "device": self.device, "dtype": self.dtype}
        decode = "decode" in self.args.only
        if decode:
            spec["decode"] = {"prompt": self.decode_load.prompts[0], "tokens": self.decode_load.max_tokens[0],
                              "repeats": self.wl.repeats}
        if "offline" in self.args.only:
            spec["offline"] = {"prompts": self.offline_a.prompts, "tokens": self.offline_a.max_tokens[0]}
        run = self.child("transformers", f"transformers-{shape}", spec, shape)
        if decode:
            note = f"{self.decode_load.describe()}, median of {self.wl.repeats}; new tokens / generate time"
            self.add(run, "eager", "decode", shape, HF_EAGER, BATCH1, "tok/s", note)
            static = self.add(run, "static", "decode", shape, HF_STATIC, BATCH1, "tok/s", note)
            if static.error is None or not self.device.startswith("cuda"):
                static.note += "; " + static_cache_note(self.device, static.detail.get("compiled"))
        if "offline" in self.args.only:
            self.add(run, "padded", "offline", shape, HF_EAGER, OFFLINE_A, "out tok/s",
                     f"{self.offline_a.describe()}; one left-padded batch")

    def neuron(self, shape: str, part: str, figure: str, load: Workload, tp: int, attention: str) -> None:
        spec = {"path": str(self.ckpt_root / shape), "device": self.device, "dtype": self.dtype, "tp": tp,
                "mode": "decode" if figure == BATCH1 else "batch", "figure": figure, "prompts": load.prompts,
                "max_tokens": load.max_tokens, "repeats": self.wl.repeats, "attention": attention}
        label = f"neuron-{attention}-{shape}-{part}" + {BATCH1: "", OFFLINE_A: "-a", OFFLINE_B: "-b"}[figure]
        run = self.child("neuron", label, spec, shape)
        engine = neuron_engine(attention, tp)
        if figure == BATCH1:
            note = f"{load.describe()}, median of {self.wl.repeats}; new tokens / generate time"
            self.add(run, figure, part, shape, engine, figure, "tok/s", note)
        else:
            self.add(run, figure, part, shape, engine, figure, "out tok/s", f"{load.describe()}; one generate call")

    def serve_attention(self) -> str:
        """The attention path with the higher offline (a) throughput on the small shape, else the first."""
        measured = [(find(self.rows, "offline", self.small, neuron_engine(m), OFFLINE_A), m)
                    for m in self.args.attention]
        measured = [(row.value, m) for row, m in measured if row is not None and row.value]
        return max(measured)[1] if measured else self.args.attention[0]

    def serve(self, attention: str) -> None:
        shape, concurrency = self.small, self.wl.serve_concurrency
        if shape in self.unbuilt:
            reason = f"failed: no {shape} checkpoint ({self.unbuilt[shape]})"
            self.rows += [serve_row(shape, c, error=reason) for c in concurrency]
            return
        server = ServeRun(self.ckpt_root / shape, self.device, self.dtype, self.work, self.args.deadline, attention)
        self.rows += server.rows(shape, concurrency, self.wl)


def neuron_engine(attention: str, tp: int = 1) -> str:
    return f"{NEURON} {attention}" if tp == 1 else f"{NEURON} {attention} tp={tp}, one device"


def static_cache_note(device: str, compiled: bool | None) -> str:
    if not device.startswith("cuda"):
        return "static cache, NOT compiled: transformers compiles the decode step only on CUDA"
    if compiled is False:
        return "static cache, NOT compiled: this transformers did not compile the decode step"
    return "static cache, decode step compiled by transformers (torch.compile, CUDA graphs), warmed up first"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", type=_choices(PARTS), default=set(PARTS),
                    help=f"comma-separated parts to run (default: all of {','.join(PARTS)})")
    ap.add_argument("--shapes", type=_choices(("0.6b", "8b")), default={"0.6b", "8b"},
                    help="comma-separated shapes for decode and offline (default: 0.6b,8b); tp2 and serve use 0.6b")
    ap.add_argument("--attention", type=_choices(ATTENTION), default=set(ATTENTION),
                    help="comma-separated attention paths neuron runs with (default: gather,paged)")
    ap.add_argument("--tiny", action="store_true",
                    help="a 2-layer hidden-64 shape and small workloads: the whole plumbing in about a minute")
    ap.add_argument("--device", help="cuda or cuda:N (default: cuda; with --tiny, cuda when present, else cpu)")
    ap.add_argument("--out", default="bench_gpu.json", help="JSON of every figure (default: %(default)s)")
    ap.add_argument("--md", default="bench_gpu.md", help="the markdown table (default: %(default)s)")
    ap.add_argument("--ckpt-dir", type=Path,
                    help="keep the checkpoints here and reuse them on later runs (default: a temporary directory)")
    ap.add_argument("--deadline", type=float, help="seconds each subprocess may take (default: 1800; 120 with --tiny)")
    args = ap.parse_args(argv)
    args.shapes = [s for s in SHAPES if s in args.shapes]  # a stable order: small first
    args.attention = [a for a in ATTENTION if a in args.attention]
    args.device = args.device or ("auto" if args.tiny else "cuda")
    args.deadline = args.deadline or (TINY if args.tiny else FULL).deadline_s
    if not args.tiny and not args.device.startswith("cuda"):
        ap.error("the published shapes need a CUDA device; --tiny runs on CPU")
    return args


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> set[str]:
        picked = {t.strip().lower() for t in text.split(",") if t.strip()}
        unknown = picked - set(allowed)
        if unknown or not picked:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}, got {text!r}")
        return picked

    return parse


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        return child_main(*argv[1:4])
    args = parse_args(argv)
    wl = TINY if args.tiny else FULL
    work = Path(tempfile.mkdtemp(prefix="bench_gpu-"))
    t0 = time.monotonic()
    bench = Bench(args, wl, work, args.ckpt_dir or work / "checkpoints")
    try:
        bench.run()
    finally:
        if args.ckpt_dir is None:
            shutil.rmtree(work / "checkpoints", ignore_errors=True)
    failed = [r for r in bench.rows if r.error and r.error.startswith("failed")]
    env = {**host_environment(), **bench.env, "run time": f"{time.monotonic() - t0:.0f} s"}
    settings = {"tiny": args.tiny, "parts": sorted(args.only), "shapes": bench.shapes, "attention": args.attention,
                "workloads": {k: getattr(wl, k) for k in wl.__dataclass_fields__}}
    doc = {"env": env, "settings": settings, "rows": [asdict(r) for r in bench.rows]}
    text = markdown(doc)
    print(text)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    Path(args.md).write_text(text)
    if failed:
        print(f"bench_gpu: {len(failed)} figure(s) failed; logs kept in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
