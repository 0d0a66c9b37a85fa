"""GGUF files quantized by llama.cpp itself load in neuron at tp 2 and decode as transformers does on
the same file: greedy tokens equal, the chosen tokens' logprobs within 1e-3.

    python scripts/check_llama_quantized.py --llama-cpp-python /work/peer-llamacpp/bin/python
    python scripts/check_llama_quantized.py --llama-cpp-python PY --hf /path/to/SmolLM2 --tp 3
    python scripts/check_llama_quantized.py --llama-cpp-python PY --source model-f16.gguf

Each source is an F32, F16 or BF16 GGUF: by default two random checkpoints built here (a Qwen3 and
a Llama, hidden 512, 4 heads of 128, intermediate 1024, so that tp 2 splits every input width into
whole 256-value K-quant blocks), written as F32 by the tests' writer; `--hf DIR` converts a
transformers checkpoint the same way, `--source FILE` takes a GGUF file as it is, and `--file FILE`
checks a file llama.cpp already quantized without quantizing it again. llama.cpp's own
`llama_model_quantize` (llama-cpp-python, run by the Python --llama-cpp-python names, a side venv:
see docs/benchmarks.md) quantizes each source to Q3_K_M, IQ4_XS, Q5_0 and Q4_1 with its own type
choices per tensor (Q6_K for the LM head, fallbacks for widths that are not multiples of 256, ...).

Each file then runs in neuron (`LLM`, tensor parallel, CPU, float32) and in transformers (its own
reading of the GGUF file), greedy on a few prompts. A file passes when every prompt's tokens are
equal and the chosen tokens' logprobs differ by at most --tol; the script exits 1 otherwise.
The environment passes through to neuron unchanged: the tolerance is for the quantized kernels'
exact path, which `NEURON_QUANT_EXACT=1` selects where neuron also has an integer-activation path
(activations rounded to 8 bits, as llama.cpp multiplies, which rounds differently from transformers).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from checkpoints import greedy_with_logprobs  # noqa: E402
from gguf_files import write_gguf  # noqa: E402  (the tests' GGUF writer: llama.cpp's layout)

TYPES = ["Q3_K_M", "IQ4_XS", "Q5_0", "Q4_1"]
# the random sources: every input width (512 hidden, 512 attention, 1024 intermediate) splits at tp
# 2 into whole blocks of 256, so llama.cpp's K-quant choices stay K-quants and tp 2 can split them;
# head_dim 128 because transformers' GGUF config for Qwen3 keeps Qwen3's default, not the file's
SHAPE = dict(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=128, max_position_embeddings=512, rms_norm_eps=1e-6,
             tie_word_embeddings=False, initializer_range=0.05, eos_token_id=None, bos_token_id=None)
PROMPTS = [[5, 17, 200, 3], list(range(10, 50)), [911, 2, 2, 640, 77, 13, 300, 8]]

# Run by the Python that has llama-cpp-python: llama.cpp quantizes argv[1] into argv[2] as the
# LLAMA_FTYPE_MOSTLY_<argv[3]> mix; prints the package's version.
QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.nthread = int(sys.argv[4])
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
if rc != 0:
    sys.exit(f"llama_model_quantize returned {rc}")
print(llama_cpp.__version__)
"""


def build_source(family: str, out: Path) -> Path:
    """A random `family` checkpoint (qwen3 or llama) written as an F32 GGUF file."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if family == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(0)
    hf = out.parent / f"{family}-hf"
    model_cls(config_cls(**SHAPE, rope_theta=10000.0)).save_pretrained(hf, safe_serialization=True)
    return write_gguf(hf, out, "F32", tokenizer=False)


def quantize(python: str, source: Path, out: Path, ftype: str) -> str:
    """llama.cpp's quantization of `source` to `ftype`; llama-cpp-python's version."""
    args = [python, "-c", QUANTIZE, str(source), str(out), ftype, str(torch.get_num_threads())]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's quantization to {ftype} failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def tensor_types(path: Path) -> str:
    """The file's matrix types as neuron's GGUF reader lists them, most common first, with how
    many tensors hold each: "Q3_K x7, Q5_K x4, Q6_K x1"."""
    from neuron.models.gguf import open_file

    file = open_file(path)
    counts: dict[str, int] = {}
    for t in file.tensors.values():
        if len(t.shape) > 1:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return ", ".join(f"{kind} x{counts[kind]}" for kind in file.types().split(", "))


def run_neuron(path: Path, tp: int, prompts: list[list[int]], tokens: int) -> list:
    from neuron import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=5, ignore_eos=True)
    with LLM(model=str(path), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def run_transformers(path: Path, prompts: list[list[int]], tokens: int) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return [greedy_with_logprobs(model, p, tokens) for p in prompts]


def compare(ours: list, reference: list) -> tuple[bool, float, float]:
    """(tokens equal on every prompt, the largest |difference| of the chosen tokens' logprobs, the
    largest over every id neuron returned, its top 5), over the steps both decoded alike."""
    same, chosen, top = True, 0.0, 0.0
    for out, (ref_tokens, ref_logprobs) in zip(ours, reference):
        same &= out.token_ids == ref_tokens
        for step, (tok, ref_tok) in enumerate(zip(out.token_ids, ref_tokens)):
            if tok != ref_tok:
                break
            lp = out.logprobs[step]
            chosen = max(chosen, abs(lp[tok] - ref_logprobs[step][tok].item()))
            top = max(top, max(abs(v - ref_logprobs[step][i].item()) for i, v in lp.items()))
    return same, chosen, top


def check(path: Path, tp: int, tokens: int, vocab: int) -> dict:
    prompts = [[t % vocab for t in p] for p in PROMPTS]
    start = time.perf_counter()
    ours = run_neuron(path, tp, prompts, tokens)
    reference = run_transformers(path, prompts, tokens)
    same, chosen, top = compare(ours, reference)
    return dict(types=tensor_types(path), same=same, chosen=chosen, top=top, seconds=time.perf_counter() - start)


def vocab_size(path: Path) -> int:
    from neuron.models.gguf import open_file

    return int(open_file(path).tensors["token_embd.weight"].shape[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp-python", default=sys.executable,
                    help="a Python with llama-cpp-python installed (a side venv; default: this one)")
    ap.add_argument("--source", action="append", default=[], help="an F32/F16/BF16 GGUF file (repeatable)")
    ap.add_argument("--hf", action="append", default=[],
                    help="a Qwen3 / Llama transformers checkpoint, written here as an F32 GGUF (repeatable)")
    ap.add_argument("--file", action="append", default=[],
                    help="a GGUF file llama.cpp already quantized, checked as it is (repeatable)")
    ap.add_argument("--types", default=",".join(TYPES), help="llama.cpp's LLAMA_FTYPE_MOSTLY_* names")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--keep", help="a folder to write the sources and quantized files to (default: a temporary one)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        sources = {Path(s).stem: Path(s) for s in args.source}
        for d in args.hf:
            sources[Path(d).name] = write_gguf(Path(d), work / f"{Path(d).name}-F32.gguf", "F32")
        if not sources and not args.file:
            for family in ("qwen3", "llama"):
                sources[f"random-{family}"] = build_source(family, work / f"random-{family}-F32.gguf")
        files, version = {(Path(f).stem, "as given"): Path(f) for f in args.file}, "(not run)"
        for name, source in sources.items():
            for ftype in args.types.split(","):
                files[(name, ftype)] = work / f"{name}-{ftype}.gguf"
                version = quantize(args.llama_cpp_python, source, files[(name, ftype)], ftype)
        results = {}
        for (name, ftype), path in files.items():
            r = results[(name, ftype)] = check(path, args.tp, args.tokens, vocab_size(path))
            print(f"{name} {ftype}: {r['types']}; tokens equal: {'yes' if r['same'] else 'NO'}, "
                  f"max |d logprob| chosen {r['chosen']:.2e}, top 5 {r['top']:.2e} ({r['seconds']:.0f} s)", flush=True)

    print(f"\nllama-cpp-python {version}, tp {args.tp}, {args.tokens} greedy tokens x {len(PROMPTS)} prompts, "
          f"torch {torch.__version__}, NEURON_QUANT_EXACT={os.environ.get('NEURON_QUANT_EXACT', '(unset)')}")
    print("| source | llama.cpp type | tensor types (neuron's reader) | tokens equal | max abs d logprob, chosen "
          "| top 5 |\n|---|---|---|---|---|---|")
    for (name, ftype), r in results.items():
        print(f"| {name} | {ftype} | {r['types']} | {'yes' if r['same'] else 'no'} | {r['chosen']:.1e} "
              f"| {r['top']:.1e} |")
    failed = [f"{n} {t}" for (n, t), r in results.items() if not r["same"] or r["chosen"] > args.tol]
    if failed:
        print(f"\nFAILED (tokens differ or logprobs beyond {args.tol}): {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
