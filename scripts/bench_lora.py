"""LoRA adapters against the bare base model, on the same checkpoint in the same run.

    python scripts/bench_lora.py                       # builds its checkpoint and adapters in a temporary folder
    python scripts/bench_lora.py --model PATH --tokens 128 --repeats 3 --json-out out.json
    python scripts/bench_lora.py --tiny                # a smoke run on a tiny model (no figures worth keeping)

Two workloads, each timed with adapters and without, through one `LLM` (greedy, EOS ignored, the
median of --repeats runs after a warm-up):

- mixed: --requests concurrent requests (16) spread over --adapters adapters (8, each of rank
  --rank 16 on every attention and MLP projection), all in one batch and every adapter resident
  (max_loras = --adapters), against the same requests on the base model;
- batch 1: one request decoding with one adapter, against the same request on the base model.

It prints output tokens per second for each and the ratios adapter / base (the targets: 0.8 for
mixed, 0.9 for batch 1 on CPU). On CPU a step of up to 16 rows runs its decoder layers in one C++
call (cpu_decoder.py) with or without adapters; a longer one (a prefill chunk) runs the Python
layers when it has adapters.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPE = dict(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_base(path: Path, shape: dict) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**shape, max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=None,
                      bos_token_id=None)
    Qwen3ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def build_adapter(path: Path, config: dict, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder of random A and B on every projection of every layer, written directly."""
    from safetensors.torch import save_file

    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv, inter = heads * head_dim, config["num_key_value_heads"] * head_dim, config["intermediate_size"]
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj, (inputs, outputs) in shapes.items():
            where = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{where}.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inputs, generator=gen) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(outputs, rank, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))
    return path


def rate(llm, prompts: list[list[int]], params, loras) -> float:
    """Output tokens per second of one `generate` of every prompt."""
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def alternated(llm, prompts: list[list[int]], params, loras, repeats: int) -> tuple[float, float]:
    """The bare base's and the adapters' rates (medians of `repeats`), one of each per round, so a
    slower stretch of the machine weighs on both."""
    base, adapted = [], []
    for _ in range(repeats):
        base.append(rate(llm, prompts, params, None))
        adapted.append(rate(llm, prompts, params, loras))
    return statistics.median(base), statistics.median(adapted)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint of the dense decoder (default: built, see SHAPE)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and few tokens: a smoke run")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    if args.tiny:
        args.tokens, args.repeats, args.prompt_tokens = min(args.tokens, 8), 1, min(args.prompt_tokens, 16)

    from neuron import LLM, LoRARequest, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.model) if args.model else build_base(Path(tmp) / "base", TINY if args.tiny else SHAPE)
        config = json.loads((base / "config.json").read_text())
        loras = [LoRARequest(f"a{i}", i + 1, str(build_adapter(Path(tmp) / f"a{i}", config, args.rank, i)))
                 for i in range(args.adapters)]
        vocab = config["vocab_size"]
        prompts = [[(17 * i + 5 * j) % vocab for j in range(args.prompt_tokens)] for i in range(args.requests)]
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        mixed = [loras[i % len(loras)] for i in range(len(prompts))]
        with LLM(str(base), tensor_parallel_size=args.tp, device="cpu", dtype="float32", enable_lora=True,
                 max_loras=args.adapters, max_lora_rank=args.rank, max_num_seqs=max(args.requests, 1),
                 enable_prefix_caching=False) as llm:
            rate(llm, prompts, params, mixed)  # warm-up: every adapter loaded into its slot
            result = dict(zip(("mixed_base_tok_s", "mixed_lora_tok_s"),
                              alternated(llm, prompts, params, mixed, args.repeats)))
            result.update(zip(("batch1_base_tok_s", "batch1_lora_tok_s"),
                              alternated(llm, prompts[:1], params, loras[:1], args.repeats)))
    result["mixed_ratio"] = result["mixed_lora_tok_s"] / result["mixed_base_tok_s"]
    result["batch1_ratio"] = result["batch1_lora_tok_s"] / result["batch1_base_tok_s"]
    result["setup"] = {"model": args.model or ("tiny" if args.tiny else SHAPE), "adapters": args.adapters,
                       "rank": args.rank, "requests": args.requests, "tokens": args.tokens, "tp": args.tp,
                       "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine()}
    print(f"mixed, {args.requests} requests over {args.adapters} adapters of rank {args.rank}: "
          f"{result['mixed_lora_tok_s']:.1f} tok/s vs base {result['mixed_base_tok_s']:.1f} tok/s "
          f"= {result['mixed_ratio']:.2f}x (target 0.8x)")
    print(f"batch 1 with one adapter: {result['batch1_lora_tok_s']:.1f} tok/s vs base "
          f"{result['batch1_base_tok_s']:.1f} tok/s = {result['batch1_ratio']:.2f}x (target 0.9x)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
