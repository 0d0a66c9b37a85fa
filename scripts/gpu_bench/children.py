"""What runs inside a child process (`bench_gpu.py _child KIND SPEC RESULT`): the environment,
copy bandwidth and checkpoints, transformers `generate`, and neuron `LLM.generate`."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from gpu_bench.checkpoints import build_checkpoint, qwen3_config
from gpu_bench.environment import device_environment


def resolve_device(device: str) -> tuple[str, str]:
    """(device, dtype): bfloat16 on CUDA as published, float32 on CPU where bfloat16 matmuls are slow."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device (torch.cuda.is_available() is False); --tiny runs on CPU")
    return device, "bfloat16" if device.startswith("cuda") else "float32"


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def copy_bandwidth(device: str, nbytes: int, iters: int = 30) -> tuple[float, dict]:
    """GB/s of a device-to-device copy, counting the bytes read and the bytes written."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    seconds = (time.perf_counter() - t0) / iters
    return 2 * nbytes / seconds / 1e9, {"bytes": nbytes, "iters": iters, "ms_per_copy": seconds * 1e3}



def prepare_child(spec: dict, out: ChildResults) -> None:
    """Environment, copy bandwidth and every checkpoint, in one process: none of them holds memory after."""
    device, dtype = resolve_device(spec["device"])
    out.put("env", None, **device_environment(device, dtype))
    out.measure("bandwidth", lambda: copy_bandwidth(device, spec["copy_bytes"]))
    for shape, path in spec["checkpoints"].items():
        out.measure(f"build:{shape}", lambda: _checkpoint(Path(path), qwen3_config(shape, dtype), device,
                                                          spec["shard_bytes"]))


def _checkpoint(path: Path, cfg: dict, device: str, shard_bytes: int) -> tuple[float, dict]:
    """Build, or reuse a complete one (config.json is written last) with the same config."""
    done = path / "config.json"
    if done.is_file() and json.loads(done.read_text()) == cfg:
        return 0.0, {"reused": str(path), "files": len(list(path.glob("*.safetensors")))}
    if path.exists():
        shutil.rmtree(path)
    t0 = time.perf_counter()
    info = build_checkpoint(path, cfg, device, shard_bytes)
    return time.perf_counter() - t0, info


def hf_load(path: str, device: str, dtype: str):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    # `dtype=` replaced `torch_dtype=` in transformers 4.56.
    key = "dtype" if _version_tuple(transformers.__version__) >= (4, 56) else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(path, **{key: getattr(torch, dtype)}).to(device).eval()


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def hf_generate(model, prompts: list[list[int]], new_tokens: int, static: bool = False) -> float:
    """Seconds for one greedy `generate` of `prompts` as one left-padded batch."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    sync(str(model.device))
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, **kwargs)
    sync(str(model.device))
    if out.shape != (len(prompts), width + new_tokens):
        raise RuntimeError(f"generate returned shape {tuple(out.shape)}, expected {(len(prompts), width + new_tokens)}")
    return time.perf_counter() - t0


def hf_batch1(model, prompt: list[int], tokens: int, repeats: int, static: bool) -> tuple[float, dict]:
    # Two full-length warm-ups: on CUDA the static-cache decode step compiles in the first and
    # its CUDA graphs are recorded by the second.
    for _ in range(2 if static else 1):
        hf_generate(model, [prompt], tokens if static else min(tokens, 8), static)
    runs = [hf_generate(model, [prompt], tokens, static) for _ in range(repeats)]
    detail = {"prompt_tokens": len(prompt), "new_tokens": tokens, "runs_s": runs}
    if static:
        detail["compiled"] = getattr(model, "_compiled_call", None) is not None
    return tokens / statistics.median(runs), detail


def hf_padded_batch(model, prompts: list[list[int]], tokens: int) -> tuple[float, dict]:
    hf_generate(model, prompts[:2], 4)
    seconds = hf_generate(model, prompts, tokens)
    return len(prompts) * tokens / seconds, {"prompts": len(prompts), "new_tokens_each": tokens, "seconds": seconds,
                                             "padded_to": max(len(p) for p in prompts)}


def transformers_child(spec: dict, out: ChildResults) -> None:
    """Eager batch 1, one padded batch, then static-cache batch 1: compilation, the likeliest to fail
    or run long, comes last so the others are already written."""
    import gc

    import torch

    model = hf_load(spec["path"], spec["device"], spec["dtype"])
    decode = spec.get("decode")
    if decode:
        out.measure("eager", lambda: hf_batch1(model, decode["prompt"], decode["tokens"], decode["repeats"], False))
    if spec.get("offline"):
        out.measure("padded", lambda: hf_padded_batch(model, spec["offline"]["prompts"], spec["offline"]["tokens"]))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if decode:
        out.measure("static", lambda: hf_batch1(model, decode["prompt"], decode["tokens"], decode["repeats"], True))


def neuron_child(spec: dict, out: ChildResults) -> None:
    """One neuron figure: batch-1 decode (median of repeats) or one offline batch, after a warm-up."""
    os.environ["NEURON_ATTENTION"] = spec["attention"]  # read when the model loads, in this process
    from neuron import LLM, SamplingParams

    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    options = dict(tensor_parallel_size=spec["tp"], device=spec["device"], dtype=spec["dtype"],
                   max_num_seqs=len(prompts) if spec["mode"] == "batch" else 1,
                   max_model_len=max(len(p) + m for p, m in zip(prompts, max_tokens)))
    with LLM(spec["path"], **options) as llm:
        def run(batch: list[list[int]], lengths: list[int]) -> tuple[float, int]:
            params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
            return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

        run(prompts[:1], [4])
        if spec["mode"] == "decode":
            out.measure(spec["figure"], lambda: _median_rate(run, prompts, max_tokens, spec["repeats"]))
        else:
            out.measure(spec["figure"], lambda: _batch_rate(run, prompts, max_tokens))


def _median_rate(run, prompts, max_tokens, repeats: int) -> tuple[float, dict]:
    runs = [run(prompts, max_tokens) for _ in range(repeats)]
    _check_tokens(runs[-1][1], sum(max_tokens))
    seconds = [s for s, _ in runs]
    return max_tokens[0] / statistics.median(seconds), {"prompt_tokens": len(prompts[0]), "new_tokens": max_tokens[0],
                                                         "runs_s": seconds}


def _batch_rate(run, prompts, max_tokens) -> tuple[float, dict]:
    seconds, tokens = run(prompts, max_tokens)
    _check_tokens(tokens, sum(max_tokens))
    return tokens / seconds, {"prompts": len(prompts), "input_tokens": sum(len(p) for p in prompts),
                              "output_tokens": tokens, "seconds": seconds}


def _check_tokens(got: int, expected: int) -> None:
    if got != expected:
        raise RuntimeError(f"generated {got} tokens, expected {expected} (ignore_eos should reach max_tokens)")


class ChildResults:
    """A child's figures, rewritten to disk after each one, so a child killed at its deadline still
    leaves the figures it finished."""

    def __init__(self, path: Path):
        self.path, self.data = path, {}

    def put(self, name: str, value: float | None, **detail) -> None:
        self.data[name] = {"value": value, "detail": detail}
        self._write()

    def measure(self, name: str, fn) -> None:
        print(f"bench_gpu: measuring {name}", file=sys.stderr, flush=True)
        try:
            value, detail = fn()
        except Exception as exc:
            import traceback

            traceback.print_exc()
            self.data[name] = {"error": _reason(exc)}
            self._write()
            return
        self.put(name, value, **detail)

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


def _reason(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 240 else text[:237] + "..."


CHILDREN = {"prepare": prepare_child, "transformers": transformers_child, "neuron": neuron_child}


def child_main(kind: str, spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    CHILDREN[kind](spec, ChildResults(Path(result_path)))
    return 0
