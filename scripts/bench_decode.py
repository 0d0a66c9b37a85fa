"""Batch-1 greedy decode: neuron's offline API against transformers `generate`, same checkpoint,
same run, and the `ping` round trip to a worker.

    python scripts/bench_decode.py                 # tiny 2-layer and ~25M-parameter Qwen3, tp 1 and 2
    python scripts/bench_decode.py --tokens 256 --repeats 5 --json-out out.json

Prints tokens/s for each and the ratio neuron / transformers. Checkpoints have random weights
and are built in a temporary directory; greedy decoding ignores EOS so every run has the same length.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "tiny-2L": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "25M": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=7,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64),
}


def build(path: Path, shape: dict) -> int:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=0.1,
                      eos_token_id=None, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def hf_tokens_per_s(path: Path, prompt: list[int], tokens: int, repeats: int, static: bool) -> float:
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model.generate(ids, **kwargs)
            times.append(time.perf_counter() - t0)
    assert out.shape[1] == len(prompt) + tokens
    return tokens / statistics.median(times)


def neuron_tokens_per_s(path: Path, prompt: list[int], tokens: int, repeats: int, tp: int) -> float:
    from neuron import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32", max_num_seqs=1) as llm:
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = llm.generate({"prompt_token_ids": prompt}, params)
            times.append(time.perf_counter() - t0)
    assert len(out[0].outputs[0].token_ids) == tokens
    return tokens / statistics.median(times)


def ping_round_trip_us(n: int = 2000) -> float:
    """Median round trip of `ping` to a live worker process over its pipes."""
    from neuron.rpc import codec
    from neuron.rpc import protocol as p

    proc = subprocess.Popen([sys.executable, "-m", "neuron", "--worker", "--rank", "1", "--tp-size", "2"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    samples = []
    try:
        for seq in range(1, n + 1):
            t0 = time.perf_counter()
            proc.stdin.write(codec.encode(p.Ping(seq=seq)))
            proc.stdin.flush()
            reply = codec.decode_reply(proc.stdout.readline())
            samples.append(time.perf_counter() - t0)
            assert isinstance(reply, p.Pong) and reply.seq == seq
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
    return statistics.median(samples[10:]) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--tp", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--json-out")
    args = ap.parse_args()

    results = {"machine": platform.machine(), "cpus": torch.get_num_threads(), "torch": torch.__version__,
               "ping_us": round(ping_round_trip_us(), 1), "runs": []}
    print(f"ping round trip (median): {results['ping_us']} us")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            path = Path(tmp) / name
            params = build(path, SHAPES[name])
            prompt = list(range(3, 3 + args.prompt_len))
            hf = hf_tokens_per_s(path, prompt, args.tokens, args.repeats, static=False)
            hf_static = hf_tokens_per_s(path, prompt, args.tokens, args.repeats, static=True)
            print(f"{name} ({params / 1e6:.1f}M params): transformers generate {hf:.1f} tok/s "
                  f"(static cache {hf_static:.1f})")
            for tp in args.tp:
                ours = neuron_tokens_per_s(path, prompt, args.tokens, args.repeats, tp)
                print(f"  neuron tp={tp}: {ours:.1f} tok/s  ratio vs transformers {ours / hf:.2f}x "
                      f"(vs static {ours / hf_static:.2f}x)")
                results["runs"].append({"shape": name, "params": params, "tp": tp, "neuron_tok_s": round(ours, 1),
                                        "hf_tok_s": round(hf, 1), "hf_static_tok_s": round(hf_static, 1),
                                        "ratio": round(ours / hf, 2)})
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
