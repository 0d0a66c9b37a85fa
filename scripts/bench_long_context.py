"""Batch-1 decode after a long prompt, where each token reads the whole context's keys and values
beside the weights: neuron with its KV cache in the model dtype (fp32) and in 16 bits
(kv_cache_dtype float16, as llama.cpp holds its cache by default), against llama.cpp on the same
GGUF file, alternated round by round.

    python scripts/bench_long_context.py --llama-cpp-python /work/peer-llamacpp/bin/python
    python scripts/bench_long_context.py --gguf model.gguf --prompt 4000 --tokens 128 --repeats 3

Without --gguf it builds bench_quant.py's random ~190M-parameter Qwen3 and writes it as Q4_K. The
prompt is `--prompt` token ids; neuron's decode is timed on a second request for the same prompt,
whose prefill the prefix cache skips (the same keys and values), llama.cpp's after its own prefill.
Each figure is the median of --repeats rounds; each ratio the median of the rounds' own ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant import build, time_llama_cpp  # noqa: E402  (the random checkpoint; llama.cpp's timing)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_files import write_gguf  # noqa: E402


def prompt_ids(length: int) -> list[int]:
    return [(37 * j) % 30000 + 5 for j in range(length)]


def neuron_rate(path: str, kv: str, prompt: list[int], tokens: int) -> float:
    """Decode tok/s of one sequence after `prompt`, its prefill cached by an earlier request."""
    from neuron import LLM, SamplingParams

    with LLM(model=path, device="cpu", dtype="float32", kv_cache_dtype=kv, max_num_seqs=1,
             max_model_len=len(prompt) + tokens + 32) as llm:
        one = [{"prompt_token_ids": prompt}]
        llm.generate(one, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # prefill, cached
        start = time.perf_counter()
        llm.generate(one, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        first = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate(one, SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True))
        return tokens / (time.perf_counter() - start - first)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", help="a GGUF file (default: the random ~190M Qwen3 as Q4_K, built here)")
    ap.add_argument("--prompt", type=int, default=2000, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded after it")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-cpp-python", default=sys.executable,
                    help="a Python with llama-cpp-python (a side venv: docs/benchmarks.md)")
    args = ap.parse_args()
    prompt = prompt_ids(args.prompt)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.gguf
        if path is None:
            build(Path(tmp) / "ckpt")
            path = str(write_gguf(Path(tmp) / "ckpt", Path(tmp) / "model-Q4_K.gguf", "Q4_K"))
        rates: dict[str, list[float]] = {"fp32 cache": [], "fp16 cache": [], "llama.cpp": []}
        for r in range(args.repeats):
            rates["fp32 cache"].append(neuron_rate(path, "auto", prompt, args.tokens))
            rates["fp16 cache"].append(neuron_rate(path, "float16", prompt, args.tokens))
            theirs = time_llama_cpp(args.llama_cpp_python, path, args.tokens, 1, prompt)
            rates["llama.cpp"].append(theirs if theirs is not None else float("nan"))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
    print(f"\nbatch-1 decode tok/s after a {args.prompt}-token prompt, {args.tokens} tokens, "
          f"medians of {args.repeats} rounds")
    for name, values in rates.items():
        line = f"{name:12s} {statistics.median(values):8.1f}"
        if name != "llama.cpp" and rates["llama.cpp"][0] == rates["llama.cpp"][0]:
            ratio = statistics.median(a / b for a, b in zip(values, rates["llama.cpp"]))
            line += f"   x llama.cpp {ratio:.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
