"""Qwen3-MoE greedy decode: neuron's offline API against transformers `generate`, same checkpoint,
same run, at batch 1 and batch 16.

    python scripts/bench_moe.py                    # small shape on CPU: 16 experts top-4, tp 1
    python scripts/bench_moe.py --experts 128 --top-k 8   # Qwen3-30B-A3B's routing, same small experts
    python scripts/bench_moe.py --tp 1,2 --tokens 128 --repeats 5 --json-out out.json
    python scripts/bench_moe.py --shape 30b-a3b --json-out moe.json    # on a GPU: 16 of 48 layers, bfloat16
    python scripts/bench_moe.py --shape tiny --device cpu              # the 30b-a3b path's plumbing on CPU

Batch 1 decodes one 16-token prompt; batch 16 decodes 16 different 16-token prompts in one
`generate` call (one batch for transformers, every prompt the same length so no padding is needed).
Prints tokens/s (all sequences together) and milliseconds per decode step for each, and the ratio
neuron / transformers. The checkpoint has random weights and is built in a temporary directory
(under TMPDIR; the drawn shapes check its free space first); it has no EOS, so every run has the
same length. `--experts` and `--top-k` change only the routing (each expert keeps its width): with
many experts and few tokens per step, most experts receive no token, which is where a per-expert
loop costs most.

Shapes (--shape):

- small (the default; CPU): hidden 256, 4 layers, 16 experts top-4, expert width 128, vocab 4096,
  tied embeddings; built and saved by transformers (its init), run in float32 by default.
- 30b-a3b: Qwen3-30B-A3B's published config (hidden 2048, 32 query / 4 KV heads of 128, 128 experts
  top-8 of width 768, normalised top-k weights, vocab 151936, untied LM head, rope theta 1e6). All
  48 layers are about 61 GB in bfloat16, more than a 64 GiB disk holds beside the rest, so
  `--layers` cuts the depth: 16 by default (10.6G parameters, 21 GB). A decode step costs a fixed
  part (the 151936 x 2048 LM head, sampling, the generate loop) plus a per-layer part times the
  depth: tok/s at 16 layers is higher than the full model's, and the ratios hold for this depth.
- tiny: the 30b-a3b path (drawn weights, untied, normalised top-k) at hidden 64, 2 layers, 8
  experts top-2, to run that path's plumbing on CPU in seconds.

30b-a3b and tiny are drawn on `--device` (randn * 0.02, norms at 1) and written straight to
safetensors in shards of about 4 GiB, with no transformers model built, in `--layout`: per-expert
(the default: `mlp.experts.N.{gate,up,down}_proj.weight`, as the published checkpoint and
transformers' save_pretrained write it; transformers fuses them at load) or fused
(`mlp.experts.gate_up_proj` [E, 2 * I, H] and `mlp.experts.down_proj` [E, H, I], transformers 5's
in-memory layout). neuron reads either.

transformers runs first (eager `generate`, no static cache or compile, with its default experts
implementation, which the output names), is freed (and the CUDA cache emptied), then neuron runs
in the same process with NEURON_ATTENTION set from `--attention`. A run still going at
`--deadline` stops with the figures it has: they are printed and written, with "error" in the JSON,
and the exit code is 1.

Time for `--shape 30b-a3b` at 16 layers on one H100, estimated (not yet run on a GPU): imports
~15 s; drawing a few seconds, writing 21 GB at 0.5-2 GB/s 10-45 s; transformers' load (fusing the
per-expert tensors, then the copy to the GPU) 30-60 s; neuron's load 15-30 s; each side's warm-up
(8 tokens) and two timed batches (32 tokens, once each) well under a minute: 2-4 minutes against
the default 540 s deadline. On a 2-core CPU VM, `--shape 30b-a3b --layers 1 --device cpu --dtype
bfloat16` (1.25G params, 2.5 GB) drew and wrote in 17.5 s (CPU randn), transformers loaded in
3.5 s and neuron in 1.6 s; the sizes at 16 layers are 8.5 times those.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# gpu_bench sits beside this script, whose directory Python puts first on sys.path.
from gpu_bench.checkpoints import QWEN3, build_checkpoint, tensor_shapes
from gpu_bench.children import hf_generate, hf_load, sync
from gpu_bench.environment import device_environment, host_environment
from gpu_bench.report import fmt_count
from gpu_bench.workloads import FULL

SHAPES = {
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=16,
                  num_experts_per_tok=4, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=32, max_position_embeddings=4096),
    # Qwen3-30B-A3B's published config.json; the weights are random.
    "30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                    num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                    num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                    norm_topk_prob=True, tie_word_embeddings=False),
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                 num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=40960, rope_theta=1000000.0, norm_topk_prob=True,
                 tie_word_embeddings=False),
}
DRAWN = ("30b-a3b", "tiny")  # drawn on the device and written directly; "small" is built by transformers
# What each shape runs with unless told: 30b-a3b keeps the whole GPU run inside one 10-minute command.
RUN_DEFAULTS = {
    "small": dict(device="cpu", tokens=64, repeats=3, deadline=None),
    "30b-a3b": dict(device="cuda", layers=16, tokens=32, repeats=1, deadline=540.0),
    "tiny": dict(device="cpu", tokens=16, repeats=1, deadline=300.0),
}
LAYOUTS = ("per-expert", "fused")
SHARD_BYTES = FULL.shard_bytes  # a drawn checkpoint's files hold about this much each, as bench_gpu's do
BATCHES = (1, 16)
WARMUP_TOKENS = 8


def build(path: Path, shape: dict) -> int:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**shape, tie_word_embeddings=True, initializer_range=0.1, eos_token_id=None,
                         bos_token_id=None)
    model = Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def drawn_config(shape: dict, dtype: str) -> dict:
    """config.json as Qwen publishes it (num_experts, rope_theta), with no EOS."""
    return {**QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "decoder_sparse_step": 1,
            "mlp_only_layers": [], "output_router_logits": False, "router_aux_loss_coef": 0.001, **shape,
            "max_window_layers": shape["num_hidden_layers"], "torch_dtype": dtype}


def moe_tensor_shapes(cfg: dict, layout: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight of a Qwen3-MoE checkpoint, in file order: Qwen3's dense list with each MLP
    replaced by its router and experts, one tensor per expert and projection or fused."""
    e, i, h = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    out = []
    for name, shape in tensor_shapes(cfg):
        if ".mlp." not in name:
            out.append((name, shape))
        elif name.endswith(".mlp.gate_proj.weight"):
            mlp = name.removesuffix("gate_proj.weight")
            out.append((mlp + "gate.weight", (e, h)))
            if layout == "fused":
                out += [(mlp + "experts.gate_up_proj", (e, 2 * i, h)), (mlp + "experts.down_proj", (e, h, i))]
            else:
                out += [(f"{mlp}experts.{x}.{proj}.weight", dims) for x in range(e)
                        for proj, dims in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)))]
    return out


def draw_checkpoint(path: Path, cfg: dict, layout: str, device: str) -> dict:
    """Every tensor drawn on `device` and written as safetensors, sharded with an index above
    SHARD_BYTES (gpu_bench's builder, with the MoE tensor list)."""
    shapes = moe_tensor_shapes(cfg, layout)
    check_disk(path.parent, sum(math.prod(s) for _, s in shapes) * getattr(torch, cfg["torch_dtype"]).itemsize)
    return build_checkpoint(path, cfg, device, SHARD_BYTES, shapes)


def check_disk(where: Path, nbytes: int) -> None:
    """Refuse before drawing rather than fail midway through writing."""
    free = shutil.disk_usage(where).free
    if nbytes > 0.95 * free:
        raise SystemExit(f"bench_moe: the checkpoint needs {nbytes / 1e9:.1f} GB and {where} has {free / 1e9:.1f} GB "
                         "free: lower --layers, or set TMPDIR to a larger disk")


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    """Distinct prompts per row, so sequences route to different experts."""
    return [[(3 + i * 131 + j * 7) % vocab for j in range(length)] for i in range(batch)]


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hf_tokens_per_s(model, batch: list[list[int]], tokens: int, repeats: int) -> float:
    hf_generate(model, batch, min(WARMUP_TOKENS, tokens))  # warm-up
    return len(batch) * tokens / statistics.median([hf_generate(model, batch, tokens) for _ in range(repeats)])


def neuron_tokens_per_s(llm, batch: list[list[int]], tokens: int, repeats: int) -> float:
    from neuron import SamplingParams

    inputs = [{"prompt_token_ids": p} for p in batch]

    def run(n: int):
        out = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == n for o in out)

    run(min(WARMUP_TOKENS, tokens))  # warm-up
    return len(batch) * tokens / median_time(lambda: run(tokens), repeats)


def release(device: str) -> None:
    """Hand a dropped model's memory back, so the next one starts on an empty device."""
    gc.collect()
    if device.startswith("cuda"):
        sync(device)
        torch.cuda.empty_cache()


def bench_hf(path: Path, args, results: dict) -> dict[int, float]:
    t0 = time.perf_counter()
    model = hf_load(str(path), args.device, args.dtype)
    info = results["transformers"] = {
        "load_s": round(time.perf_counter() - t0, 1), "tok_s": {},
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    print(f"  transformers: loaded in {info['load_s']} s, experts {info['experts_implementation']}, "
          f"attention {info['attn_implementation']}", flush=True)
    try:
        for b in BATCHES:
            rate = hf_tokens_per_s(model, prompts(b, args.prompt_len, args.vocab), args.tokens, args.repeats)
            info["tok_s"][b] = round(rate, 1)
        return dict(info["tok_s"])
    finally:
        del model
        release(args.device)


def bench_neuron(path: Path, args, tp: int) -> tuple[dict[int, float], float]:
    """tok/s per batch size, and the load time in seconds."""
    from neuron import LLM

    options = dict(tensor_parallel_size=tp, device=args.device, dtype=args.dtype, max_num_seqs=max(BATCHES))
    if args.shape in DRAWN:  # the drawn shapes' 40960 positions would size a CPU KV cache for that length
        options["max_model_len"] = args.prompt_len + args.tokens
    t0 = time.perf_counter()
    with LLM(str(path), **options) as llm:
        load_s = time.perf_counter() - t0
        rates = {b: neuron_tokens_per_s(llm, prompts(b, args.prompt_len, args.vocab), args.tokens, args.repeats)
                 for b in BATCHES}
    del llm
    release(args.device)
    return rates, load_s


def step_ms(batch: int, tok_s: float) -> float:
    return 1000 * batch / tok_s


def run(path: Path, args, shape: dict, results: dict) -> None:
    t0 = time.perf_counter()
    if args.shape in DRAWN:
        info = draw_checkpoint(path, drawn_config(shape, args.dtype), args.layout, args.device)
    else:
        info = {"params": build(path, shape), "files": 1}
    info["build_s"] = round(time.perf_counter() - t0, 1)
    results["checkpoint"] = info
    params = info["params"]
    depth = shape["num_hidden_layers"]
    full = SHAPES[args.shape]["num_hidden_layers"]
    layers = f"{depth} of {full} layers" if depth != full else f"{depth} layers"
    print(f"checkpoint {args.shape}: {fmt_count(params)} params, {layers}, {args.layout} layout, {args.dtype}, "
          f"{info['files']} safetensors file(s), built in {info['build_s']} s", flush=True)
    hf = bench_hf(path, args, results)
    print(f"qwen3-moe ({fmt_count(params)} params, {args.experts} experts top-{args.top_k}, {layers}): "
          "transformers generate "
          + ", ".join(f"batch {b} {hf[b]:.1f} tok/s ({step_ms(b, hf[b]):.1f} ms/step)" for b in BATCHES), flush=True)
    for tp in (int(t) for t in args.tp.split(",")):
        ours, load_s = bench_neuron(path, args, tp)
        print(f"  neuron tp={tp}: loaded in {load_s:.1f} s, NEURON_ATTENTION={args.attention}", flush=True)
        for b in BATCHES:
            print(f"  neuron tp={tp} batch {b}: {ours[b]:.1f} tok/s ({step_ms(b, ours[b]):.1f} ms/step)  "
                  f"ratio vs transformers {ours[b] / hf[b]:.2f}x", flush=True)
            results["runs"].append({"tp": tp, "batch": b, "params": params, "neuron_tok_s": round(ours[b], 1),
                                    "hf_tok_s": round(hf[b], 1), "ratio": round(ours[b] / hf[b], 2),
                                    "neuron_load_s": round(load_s, 1)})
    if depth != full:
        print(f"note: {layers} only; a step's time is a fixed part plus a per-layer part times the depth, so "
              f"the full {full}-layer model decodes slower than this, and the ratios hold at this depth")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=tuple(SHAPES), default="small", help="model shape (default: %(default)s)")
    ap.add_argument("--layers", type=int, help="decoder layers (default: 16 for 30b-a3b, else the shape's)")
    ap.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda for 30b-a3b, else cpu)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                    help="weights and activations, both sides (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--layout", choices=LAYOUTS,
                    help="expert tensors of a drawn checkpoint (30b-a3b, tiny) (default: per-expert)")
    ap.add_argument("--attention", choices=("gather", "paged"), default=os.environ.get("NEURON_ATTENTION") or "gather",
                    help="neuron's NEURON_ATTENTION (default: the variable's value, else gather)")
    ap.add_argument("--tokens", type=int, help="new tokens per sequence (default: 32 for 30b-a3b, 16 tiny, 64 small)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, help="timed runs, median (default: 1 for 30b-a3b and tiny, 3 small)")
    ap.add_argument("--tp", default="1", help="comma-separated tensor-parallel sizes, e.g. 1,2")
    ap.add_argument("--experts", type=int, help="experts per MoE layer (default: the shape's)")
    ap.add_argument("--top-k", type=int, help="experts per token (default: the shape's)")
    ap.add_argument("--deadline", type=float,
                    help="seconds the whole run may take (default: 540 for 30b-a3b, 300 tiny, none small)")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    for key, value in RUN_DEFAULTS[args.shape].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    dims = SHAPES[args.shape]
    args.layers = args.layers or dims["num_hidden_layers"]
    args.experts = args.experts or dims["num_experts"]
    args.top_k = args.top_k or dims["num_experts_per_tok"]
    args.vocab = dims["vocab_size"]
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.shape not in DRAWN and args.layout == "fused":
        ap.error("--layout fused is for the drawn shapes (30b-a3b, tiny); transformers writes small per expert")
    args.layout = args.layout or "per-expert"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch sees no CUDA device; on CPU run --shape tiny --device cpu")
    return args


class DeadlinePassed(Exception):
    pass


def arm_deadline(seconds: float) -> None:
    """Raise DeadlinePassed in the main thread `seconds` from now."""
    def stop(*_):
        raise DeadlinePassed(f"stopped at the --deadline of {seconds:g} s")

    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["NEURON_ATTENTION"] = args.attention  # read when neuron loads the model, in this process
    shape = dict(SHAPES[args.shape], num_experts=args.experts, num_experts_per_tok=args.top_k,
                 num_hidden_layers=args.layers)
    env = {**host_environment(), **device_environment(args.device, args.dtype)}
    where = f"{args.device} ({env['gpu']}, driver {env['driver']})" if args.device.startswith("cuda") else args.device
    print(f"bench_moe: {where}, {args.dtype}, torch {env['torch']}, transformers {env['transformers']}, "
          f"NEURON_ATTENTION={args.attention}", flush=True)
    results = {"machine": platform.machine(), "cpus": torch.get_num_threads(), "torch": torch.__version__,
               "shape_name": args.shape, "shape": shape, "layers": args.layers,
               "full_layers": SHAPES[args.shape]["num_hidden_layers"], "device": args.device, "dtype": args.dtype,
               "attention": args.attention, "layout": args.layout, "tokens": args.tokens, "prompt_len": args.prompt_len,
               "repeats": args.repeats, "deadline_s": args.deadline, "env": env, "runs": []}
    t0 = time.monotonic()
    if args.deadline:
        arm_deadline(args.deadline)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_moe-") as tmp:
            try:
                run(Path(tmp) / "moe", args, shape, results)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)  # never inside the directory's removal
    except DeadlinePassed as exc:
        results["error"] = str(exc)
        print(f"bench_moe: {exc}; the figures above are all it measured", file=sys.stderr)
    results["elapsed_s"] = round(time.monotonic() - t0, 1)
    print(f"bench_moe: {results['elapsed_s']} s in all", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 1 if "error" in results else 0


if __name__ == "__main__":
    raise SystemExit(main())
