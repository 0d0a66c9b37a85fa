"""A BERT embedding model converted by llama.cpp's own converter, in neuron and in llama.cpp: the same
token ids, the same vectors, and each engine's embedding throughput on the same file.

    python scripts/check_gguf_encoder.py --llama-cpp-src DIR --llama-cpp-python PY
    python scripts/check_gguf_encoder.py --llama-cpp-src DIR --llama-cpp-python PY --types f16,q8_0 --tp 2

DIR is llama.cpp's source tree, whose convert_hf_to_gguf.py (with its own gguf-py) makes the files
(llama-cpp-python's source archive holds one under vendor/llama.cpp: `pip download --no-binary :all:
--no-deps llama-cpp-python`); PY a Python with llama-cpp-python, set up as docs/benchmarks.md says.
The checkpoint is bench_embed.py's random BERT of bert-base's shape (mean pooling, normalized; made
under .bench/ unless --checkpoint names one); its random vocabulary has no tokenizer hash the
converter knows, so the converter is told BERT's pre-tokenizer, which a WordPiece vocabulary does
not read. Each --types file is embedded by both engines: --num-prompts texts of 20-200 words (some
upper-cased, some accented, some punctuated), in one call after a warm-up, on --threads threads.
Prints, per file, whether every text's token ids are llama.cpp's, the largest absolute difference
between the two engines' normalized vectors, each engine's tokens/s and neuron / llama.cpp; exits 1
when ids differ or a vector differs by more than --tol (2e-3 for a quantized file: both engines
round its activations to 8 bits, each its own way).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_embed import make_checkpoint  # noqa: E402  (the random BERT-base checkpoint)

# Run by the Python of the converter: llama.cpp's convert_hf_to_gguf.py, told BERT's pre-tokenizer.
CONVERT = """
import runpy, sys
src = sys.argv[1]
sys.path.insert(0, src)
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "bert-bge"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""

# Run by the Python with llama-cpp-python: argv[1] the file, argv[2] a JSON file of texts, argv[3]
# threads, argv[4] how many vectors to return, argv[5] tokens a batch (its context: llama.cpp attends
# over a whole batch, masked, so larger batches are slower). Prints JSON: ids, vectors, seconds, tokens.
LLAMA = """
import json, sys, time
from llama_cpp import Llama
texts = json.load(open(sys.argv[2]))
batch = int(sys.argv[5])
m = Llama(model_path=sys.argv[1], embedding=True, verbose=False, n_ctx=batch, n_batch=batch, n_ubatch=batch,
          n_threads=int(sys.argv[3]), n_threads_batch=int(sys.argv[3]), pooling_type=1)
ids = [m.tokenize(t.encode(), add_bos=True, special=False) for t in texts]
m.embed(texts[:4], normalize=True)
start = time.perf_counter()
vectors = m.embed(texts, normalize=True)
seconds = time.perf_counter() - start
print(json.dumps({"ids": ids, "vectors": vectors[:int(sys.argv[4])], "seconds": seconds,
                  "tokens": sum(map(len, ids))}))
"""


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp-src", type=Path, required=True)
    ap.add_argument("--llama-cpp-python", required=True)
    ap.add_argument("--checkpoint", type=Path, default=ROOT / ".bench" / "bert-base-random")
    ap.add_argument("--types", default="f32,f16,q8_0")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--tol", type=float, default=1e-4, help="for F32 and F16 files; 2e-3 for quantized ones, "
                    "whose activations both engines round to 8 bits, each its own way")
    ap.add_argument("--checked", type=int, default=16, help="texts whose vectors are compared")
    ap.add_argument("--llama-batch", type=int, default=256,
                    help="llama.cpp's batch and context: at least the longest input's tokens; of 256, 512 and 1,024 "
                         "256 was its fastest on these inputs")
    return ap.parse_args()


def texts(n: int, vocab: int) -> list[str]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        words = [f"w{rng.randrange(vocab - 5)}" for _ in range(rng.randint(20, 200))]
        for k in range(0, len(words), 17):  # BERT's normaliser and splitting at work
            words[k] = rng.choice([words[k].upper(), words[k] + ",", "(" + words[k] + ")", "Äccént", words[k] + "."])
        out.append(" ".join(words))
    return out


def main() -> None:
    a = parse()
    if not (a.checkpoint / "config.json").is_file():
        print(f"making {a.checkpoint}", flush=True)
        make_checkpoint(a.checkpoint, "bert")
    vocab = json.loads((a.checkpoint / "config.json").read_text())["vocab_size"]
    inputs = texts(a.num_prompts, vocab)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "texts.json").write_text(json.dumps(inputs))
        for kind in a.types.split(","):
            path = Path(tmp) / f"model-{kind}.gguf"
            env = {**os.environ, "PYTHONPATH": str(a.llama_cpp_src / "gguf-py")}
            subprocess.run([sys.executable, "-c", CONVERT, str(a.llama_cpp_src), str(a.checkpoint), "--outfile",
                            str(path), "--outtype", kind], env=env, check=True, capture_output=True)
            peer = json.loads(subprocess.run([a.llama_cpp_python, "-c", LLAMA, str(path), str(Path(tmp) / "texts.json"),
                                              str(a.threads), str(a.checked), str(a.llama_batch)],
                                             check=True, capture_output=True, text=True).stdout)
            ours = neuron(path, inputs, a)
            same_ids = ours["ids"] == peer["ids"]
            diff = max(abs(x - y) for u, v in zip(ours["vectors"], peer["vectors"]) for x, y in zip(u, v))
            rate, peer_rate = ours["tokens"] / ours["seconds"], peer["tokens"] / peer["seconds"]
            print(f"{kind:5} ids equal: {same_ids}  max |vector diff| {diff:.1e}  neuron {rate:7.1f} tok/s  "
                  f"llama.cpp {peer_rate:7.1f} tok/s  ratio {rate / peer_rate:.2f}x  ({ours['tokens']} tokens)",
                  flush=True)
            failed |= not same_ids or diff > (a.tol if kind in ("f32", "f16", "bf16") else 2e-3)
    sys.exit(1 if failed else 0)


def neuron(path: Path, inputs: list[str], a: argparse.Namespace) -> dict:
    from neuron import LLM

    with LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=a.tp) as llm:
        ids = [llm.engine.tokenizer.encode(t, add_special_tokens=True) for t in inputs]
        llm.embed(inputs[:4])
        start = time.perf_counter()
        outs = llm.embed(inputs)
        seconds = time.perf_counter() - start
    return {"ids": ids, "vectors": [o.outputs.embedding for o in outs[:a.checked]], "seconds": seconds,
            "tokens": sum(map(len, ids))}


if __name__ == "__main__":
    main()
