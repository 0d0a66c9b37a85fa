"""Qwen3-MoE greedy decode: neuron's offline API against transformers `generate`, same checkpoint,
same run, at batch 1 and batch 16.

    python scripts/bench_moe.py                    # 16 experts top-4, tp 1
    python scripts/bench_moe.py --experts 128 --top-k 8   # Qwen3-30B-A3B's routing, same small experts
    python scripts/bench_moe.py --tp 1,2 --tokens 128 --repeats 5 --json-out out.json

Batch 1 decodes one 16-token prompt; batch 16 decodes 16 different 16-token prompts in one
`generate` call (one batch for transformers, every prompt the same length so no padding is needed).
Prints tokens/s (all sequences together) for each and the ratio neuron / transformers. The
checkpoint has random weights and is built in a temporary directory; greedy decoding ignores EOS
so every run has the same length. `--experts` and `--top-k` change only the routing (each expert keeps
its width): with many experts and few tokens per step, most experts receive no token, which is
where a per-expert loop costs most.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=16,
             num_experts_per_tok=4, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
             max_position_embeddings=4096)
BATCHES = (1, 16)


def build(path: Path, shape: dict) -> int:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**shape, tie_word_embeddings=True, initializer_range=0.1, eos_token_id=None,
                         bos_token_id=None)
    model = Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def prompts(batch: int, length: int) -> list[list[int]]:
    """Distinct prompts per row, so sequences route to different experts."""
    return [[(3 + i * 131 + j * 7) % SHAPE["vocab_size"] for j in range(length)] for i in range(batch)]


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hf_tokens_per_s(model, batch: list[list[int]], tokens: int, repeats: int) -> float:
    ids = torch.tensor(batch)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(n: int):
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        assert out.shape == (len(batch), ids.shape[1] + n)

    with torch.inference_mode():
        run(8)  # warm-up
        return len(batch) * tokens / median_time(lambda: run(tokens), repeats)


def neuron_tokens_per_s(llm, batch: list[list[int]], tokens: int, repeats: int) -> float:
    from neuron import SamplingParams

    inputs = [{"prompt_token_ids": p} for p in batch]

    def run(n: int):
        out = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == n for o in out)

    run(8)  # warm-up
    return len(batch) * tokens / median_time(lambda: run(tokens), repeats)


def bench_hf(path: Path, args) -> dict[int, float]:
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return {b: hf_tokens_per_s(model, prompts(b, args.prompt_len), args.tokens, args.repeats) for b in BATCHES}


def bench_neuron(path: Path, args, tp: int) -> dict[int, float]:
    from neuron import LLM

    with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32", max_num_seqs=max(BATCHES)) as llm:
        return {b: neuron_tokens_per_s(llm, prompts(b, args.prompt_len), args.tokens, args.repeats) for b in BATCHES}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp", default="1", help="comma-separated tensor-parallel sizes, e.g. 1,2")
    ap.add_argument("--experts", type=int, default=SHAPE["num_experts"], help="experts per MoE layer")
    ap.add_argument("--top-k", type=int, default=SHAPE["num_experts_per_tok"], help="experts per token")
    ap.add_argument("--json-out")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    shape = dict(SHAPE, num_experts=args.experts, num_experts_per_tok=args.top_k)
    results = {"machine": platform.machine(), "cpus": torch.get_num_threads(), "torch": torch.__version__,
               "shape": shape, "tokens": args.tokens, "prompt_len": args.prompt_len, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "moe"
        params = build(path, shape)
        hf = bench_hf(path, args)
        print(f"qwen3-moe ({params / 1e6:.1f}M params, {args.experts} experts top-{args.top_k}): "
              "transformers generate "
              + ", ".join(f"batch {b} {hf[b]:.1f} tok/s" for b in BATCHES))
        for tp in (int(t) for t in args.tp.split(",")):
            ours = bench_neuron(path, args, tp)
            for b in BATCHES:
                print(f"  neuron tp={tp} batch {b}: {ours[b]:.1f} tok/s  ratio vs transformers {ours[b] / hf[b]:.2f}x")
                results["runs"].append({"tp": tp, "batch": b, "params": params, "neuron_tok_s": round(ours[b], 1),
                                        "hf_tok_s": round(hf[b], 1), "ratio": round(ours[b] / hf[b], 2)})
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
