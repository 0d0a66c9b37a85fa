"""CPU decode of one checkpoint held in different ways: fp32, bf16, int8 and fp8 quantized at load, and GGUF
files of the same weights (Q8_0, Q4_K), with llama.cpp (llama-cpp-python, in this Python or the
one --llama-cpp-python names: a side venv, set up as docs/benchmarks.md's "Quantized weights on CPU"
says) on the same GGUF files, "not installed" where it is missing.

    python scripts/bench_quant.py                          # a random ~190M-parameter Qwen3, built here
    python scripts/bench_quant.py --checkpoint DIR --tokens 64 --repeats 3 --json-out out.json
    python scripts/bench_quant.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --exact --llama-cpp-python PY
    python scripts/bench_quant.py --only int8,Q8_0,Q4_K --exact   # the integer kernel against the exact one
    python scripts/bench_quant.py --gguf FILE --prefill 2000 --llama-cpp-python PY   # long prompts too

For each: weight bytes per rank (what the ranks report after loading), batch-1 decode tok/s (one
sequence) and batch-16 decode tok/s (16 sequences at once), each the median of --repeats rounds, and
the ratio to fp32; with --prefill N, also the prompt tok/s of one N-token prompt (its first token's
time, llama.cpp's `eval` of the prompt), against llama.cpp's on the GGUF files. llama.cpp decodes
each GGUF file once after every round of neuron's, and the ratio to it is the median of the rounds'
own ratios: a shared VM's memory bandwidth drifts by a third over minutes, more than the engines
differ. Greedy decoding ignores EOS so every run has the same length.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_files import write_gguf  # noqa: E402  (the tests' GGUF writer: llama.cpp's layout, K-quants included)

# ~190M parameters: 8 layers of hidden 1024, a 32000-token vocabulary, untied
SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128)
PROMPT_TOKENS = 16


def build(path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**SHAPE, max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.02,
                      eos_token_id=None, bos_token_id=None)
    Qwen3ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def prompts(count: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 1000 + 5 for j in range(PROMPT_TOKENS)] for i in range(count)]


def decode_rate(llm, tokens: int, batch: int) -> float:
    """Decode tok/s of `batch` sequences at once: the same batch with 1 token and with `tokens`
    tokens, the difference."""
    from neuron import SamplingParams

    inputs = [{"prompt_token_ids": p} for p in prompts(batch)]
    start = time.perf_counter()
    llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    return batch * (tokens - 1) / max(time.perf_counter() - start - prefill, 1e-9)


def long_prompt(length: int, seed: int = 0) -> list[int]:
    return [(31 * j + 7 * seed + 7) % 997 + 3 for j in range(length)]


def prefill_rate(llm, length: int, seed: int) -> float:
    """Prompt tok/s of one `length`-token prompt, a new one each round (no prefix-cache hit): the
    time to its first token."""
    from neuron import SamplingParams

    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": long_prompt(length, seed)}], SamplingParams(temperature=0.0, max_tokens=1))
    return length / (time.perf_counter() - start)


def time_neuron(variants: dict, tokens: int, repeats: int, batch: int, each_round=None, prefill: int = 0) -> dict:
    """Every variant loaded at once and measured in turn, round after round, so that a machine whose
    speed drifts (a shared VM) shifts all of them alike: per variant, rank 0's weight bytes, the
    median batch-1 and batch-`batch` decode tok/s, and each round's batch-1 figure. `each_round()`
    runs after each round (the peer's turn)."""
    from neuron import LLM, SamplingParams

    llms = {}
    for name, (model, kwargs) in variants.items():
        exact = kwargs.pop("exact", False)
        os.environ["NEURON_QUANT_EXACT"] = "1" if exact else "0"  # read when the model loads
        llms[name] = LLM(model, device="cpu", max_num_seqs=batch, max_model_len=max(512, prefill + 16), **kwargs)
    os.environ.pop("NEURON_QUANT_EXACT")
    try:
        for llm in llms.values():  # warm-up
            llm.generate([{"prompt_token_ids": p} for p in prompts(batch)],
                         SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        rates = {name: ([], [], []) for name in llms}
        for round_ in range(repeats):
            for name, llm in llms.items():
                rates[name][0].append(decode_rate(llm, tokens, 1))
                rates[name][1].append(decode_rate(llm, tokens, batch))
                if prefill:
                    rates[name][2].append(prefill_rate(llm, prefill, round_ + 1))
            if each_round is not None:
                each_round()
        return {name: dict(weight_bytes=llm.engine.executor.weight_bytes[0],
                           batch1_tok_s=statistics.median(rates[name][0]),
                           batchN_tok_s=statistics.median(rates[name][1]), batch1_rounds=rates[name][0],
                           batchN_rounds=rates[name][1],
                           **(dict(prefill_tok_s=statistics.median(rates[name][2]), prefill_rounds=rates[name][2])
                              if prefill else {}))
                for name, llm in llms.items()}
    finally:
        for llm in llms.values():
            llm.shutdown()


# Run by the Python that has llama-cpp-python (this one, or --llama-cpp-python's): greedy decode of
# one sequence after the same 16-token prompt, the median of `repeats` runs after one untimed (the
# first decode pays llama.cpp's one-time setup). The next token is read from the context's last
# logits: llama-cpp-python 0.3 fills `Llama.scores` only with logits_all=True, so reading scores
# decoded token 0 at every step.
LLAMA_CPP = """
import statistics, sys, time
import llama_cpp, numpy as np
path, tokens, repeats, threads, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), eval(sys.argv[5])
n_ctx = max(512, len(prompt) + tokens + 16)
llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                      verbose=False)
def greedy():
    logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return int(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),)).argmax())
rates = []
for _ in range(repeats + 1):
    llm.reset()
    llm.eval(prompt)
    start = time.perf_counter()
    for _ in range(tokens):
        llm.eval([greedy()])
    rates.append(tokens / (time.perf_counter() - start))
print(statistics.median(rates[1:]))
"""


# llama.cpp's prompt tok/s: `eval` of the prompt from an empty context, the median of `repeats`
# runs after one untimed.
LLAMA_CPP_PREFILL = """
import statistics, sys, time
import llama_cpp
path, repeats, threads, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), eval(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=len(prompt) + 16, n_threads=threads, n_threads_batch=threads,
                      n_batch=512, verbose=False)
rates = []
for _ in range(repeats + 1):
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    rates.append(len(prompt) / (time.perf_counter() - start))
print(statistics.median(rates[1:]))
"""


def _run_llama_cpp(python: str, script: str, args: list[str]) -> float | None:
    import subprocess

    done = subprocess.run([python, "-c", script, *args], capture_output=True, text=True)
    if done.returncode != 0:
        if "No module named 'llama_cpp'" in done.stderr:
            return None
        raise RuntimeError(f"llama.cpp run failed: {done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def time_llama_cpp_prefill(python: str, path: str, length: int, repeats: int) -> float | None:
    """llama.cpp's prompt tok/s on the same GGUF file and prompt; None where `python` lacks it."""
    return _run_llama_cpp(python, LLAMA_CPP_PREFILL,
                          [path, str(repeats), str(torch.get_num_threads()), repr(long_prompt(length))])


def time_llama_cpp(python: str, path: str, tokens: int, repeats: int, prompt: list[int] | None = None) -> float | None:
    """llama.cpp's batch-1 decode tok/s on the same GGUF file after `prompt` (the 16-token one by
    default); None where `python` lacks llama-cpp-python."""
    return _run_llama_cpp(python, LLAMA_CPP, [path, str(tokens), str(repeats), str(torch.get_num_threads()),
                                              repr(prompt or prompts(1)[0])])


def _round_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median of each round's ratio: figures of one round are seconds apart, of two rounds minutes."""
    return statistics.median(a / b for a, b in zip(ours, theirs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a Qwen3 / Llama checkpoint directory (default: a random one built here)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="the larger batch (the smaller is 1)")
    ap.add_argument("--only", help="comma-separated variants to run (fp32, bf16, int8, fp8, Q8_0, Q4_K)")
    ap.add_argument("--gguf", help="instead: one GGUF file as it is (a published model's, say), in neuron and "
                    "llama.cpp")
    ap.add_argument("--llama-cpp-python", default=sys.executable,
                    help="a Python with llama-cpp-python installed (a side venv; default: this one)")
    ap.add_argument("--exact", action="store_true",
                    help="also run each int8 and 4-bit variant on the exact fp32 kernel (NEURON_QUANT_EXACT=1), "
                    "as '<variant> exact', in the same rounds")
    ap.add_argument("--prefill", type=int, default=0,
                    help="also time one prompt of this many tokens (prompt tok/s), against llama.cpp's on the "
                    "GGUF files")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.checkpoint) if args.checkpoint else Path(tmp) / "ckpt"
        if not args.checkpoint and not args.gguf:
            build(ckpt)
        variants = {} if args.gguf else {"fp32": (str(ckpt), dict(dtype="float32")), "bf16": (str(ckpt), dict(dtype="bfloat16")),
                    "int8": (str(ckpt), dict(dtype="float32", quantization="int8")),
                    "fp8": (str(ckpt), dict(dtype="float32", quantization="fp8"))}
        gguf_files = {}
        if args.gguf:
            gguf_files["file"] = Path(args.gguf)
            variants["file"] = (args.gguf, dict(dtype="float32"))
        for kind in ("Q8_0", "Q4_K"):
            if args.gguf or args.only and kind not in args.only.split(","):
                continue
            gguf_files[kind] = write_gguf(ckpt, Path(tmp) / f"model-{kind}.gguf", kind)
            variants[kind] = (str(gguf_files[kind]), dict(dtype="float32"))
        wanted = set(args.only.split(",")) if args.only else set(variants)
        if args.exact:
            for name in [n for n in ("int8", "Q8_0", "Q4_K", "file") if n in wanted and n in variants]:
                model, kwargs = variants[name]
                variants[f"{name} exact"] = (model, dict(kwargs, exact=True))
                wanted.add(f"{name} exact")
        # llama.cpp takes its turn on each file after every round of neuron's, so that the ratios
        # compare runs minutes apart at most, not one engine's rounds against the other's
        peers = {name: [] for name in gguf_files if name in wanted}
        peer_prefills = {name: [] for name in peers}

        def llama_cpp_round() -> None:
            for name, rounds in peers.items():
                if None in rounds:  # llama-cpp-python is not installed there
                    return
                rounds.append(time_llama_cpp(args.llama_cpp_python, str(gguf_files[name]), args.tokens, 1))
                if args.prefill and rounds[-1] is not None:
                    peer_prefills[name].append(
                        time_llama_cpp_prefill(args.llama_cpp_python, str(gguf_files[name]), args.prefill, 1))

        results = time_neuron({k: v for k, v in variants.items() if k in wanted}, args.tokens, args.repeats,
                              args.batch, llama_cpp_round, args.prefill)
        for name, rounds in peers.items():
            r = results[name]
            r["llama_cpp_batch1_tok_s"] = None
            if rounds and None not in rounds:
                r.update(llama_cpp_batch1_tok_s=statistics.median(rounds), llama_cpp_rounds=rounds,
                         vs_llama_cpp=_round_ratio(r["batch1_rounds"], rounds))
                if args.prefill:
                    theirs = peer_prefills[name]
                    r.update(llama_cpp_prefill_tok_s=statistics.median(theirs), llama_cpp_prefill_rounds=theirs,
                             prefill_vs_llama_cpp=_round_ratio(r["prefill_rounds"], theirs))

    base = results.get("fp32")
    bf16 = results.get("bf16")
    print(f"\n{'variant':8} {'MiB/rank':>9} {'x bf16 B':>9} {'b1 tok/s':>9} {'x fp32':>7} "
          f"{f'b{args.batch} tok/s':>10} {'x fp32':>7} {'llama.cpp b1':>13} {'x llama.cpp':>12}")
    for name, r in results.items():
        vs_bf16 = f"{r['weight_bytes'] / bf16['weight_bytes']:.2f}" if bf16 else "-"
        x1 = f"{_round_ratio(r['batch1_rounds'], base['batch1_rounds']):.2f}" if base else "-"
        xn = f"{_round_ratio(r['batchN_rounds'], base['batchN_rounds']):.2f}" if base else "-"
        lc = r.get("llama_cpp_batch1_tok_s")
        lc_text = "-" if name not in gguf_files else ("not installed" if lc is None else f"{lc:.1f}")
        vs = f"{r['vs_llama_cpp']:.2f}" if "vs_llama_cpp" in r else "-"
        print(f"{name:8} {r['weight_bytes'] / 2**20:9.1f} {vs_bf16:>9} {r['batch1_tok_s']:9.1f} {x1:>7} "
              f"{r['batchN_tok_s']:10.1f} {xn:>7} {lc_text:>13} {vs:>12}")
    if args.prefill:
        print(f"\n{'variant':8} {f'prefill {args.prefill} tok/s':>20} {'x fp32':>7} {'llama.cpp':>10} "
              f"{'x llama.cpp':>12}")
        for name, r in results.items():
            x = f"{_round_ratio(r['prefill_rounds'], base['prefill_rounds']):.2f}" if base else "-"
            lc = r.get("llama_cpp_prefill_tok_s")
            lc_text = "-" if name not in gguf_files else ("not installed" if lc is None else f"{lc:.1f}")
            vs = f"{r['prefill_vs_llama_cpp']:.2f}" if "prefill_vs_llama_cpp" in r else "-"
            print(f"{name:8} {r['prefill_tok_s']:20.1f} {x:>7} {lc_text:>10} {vs:>12}")
    print("\ntok/s: medians of the rounds; x fp32 and x llama.cpp: medians of each round's own ratio (llama.cpp's "
          "turn follows neuron's in every round)")
    print(f"\n{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(dict(tokens=args.tokens, batch=args.batch, results=results), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
