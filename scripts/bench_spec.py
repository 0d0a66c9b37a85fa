"""Speculative decoding (n-gram proposals) on CPU: neuron with and without it, and transformers'
prompt-lookup decoding, on the same checkpoint and prompts in one run.

    python scripts/bench_spec.py                      # builds its checkpoint in a temporary folder
    python scripts/bench_spec.py --tokens 96 --repeats 3 --json-out out.json

The workload is input-grounded the way a random-weight model allows: the checkpoint (the 191M
benchmark shape with a 512-token vocabulary) falls into runs of repeated tokens, and each prompt is
a seed followed by the model's own greedy continuation of it, so what the model generates next
repeats spans it has already seen, as summaries and code edits repeat their inputs. Greedy, EOS
ignored; batch 1 (one prompt) and batch 32 (32 prompts at once); the medians of --repeats runs. The
acceptance rate is neuron's (accepted / proposed tokens) over the timed runs.
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

SHAPE = dict(vocab_size=512, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def build(path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**SHAPE, max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.02,
                      eos_token_id=None, bos_token_id=None)
    Qwen3ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def grounded_prompts(model: str, count: int, seed_len: int, grounding: int) -> list[list[int]]:
    """Seeds and the model's own greedy continuation of each (what the next tokens will repeat)."""
    from neuron import LLM, SamplingParams

    seeds = [[(37 * i + 13 * j) % SHAPE["vocab_size"] for j in range(seed_len)] for i in range(count)]
    with LLM(model, device="cpu", dtype="float32", max_num_seqs=count, max_model_len=1024) as llm:
        outs = llm.generate([{"prompt_token_ids": s} for s in seeds],
                            SamplingParams(temperature=0.0, max_tokens=grounding, ignore_eos=True))
    return [s + o.outputs[0].token_ids for s, o in zip(seeds, outs)]


def time_neuron(model: str, prompts: list[list[int]], tokens: int, repeats: int) -> dict:
    """Without and with speculation, both loaded at once and run in turn, round after round (the
    VM's speed drifts): per variant and batch size, (median tok/s, acceptance, outputs)."""
    from neuron import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llms = {name: LLM(model, device="cpu", dtype="float32", max_num_seqs=len(prompts), max_model_len=1024,
                      speculative_config=spec) for name, spec in (("plain", None), ("ngram", SPEC))}
    try:
        rates = {(name, b): [] for name in llms for b in (1, len(prompts))}
        counts, outputs = {}, {}
        for llm in llms.values():
            llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(temperature=0.0, max_tokens=4))
        for batch in (1, len(prompts)):
            inputs = [{"prompt_token_ids": p} for p in prompts[:batch]]
            before = list(llms["ngram"].engine.spec_counts)
            for _ in range(repeats):
                for name, llm in llms.items():
                    start = time.perf_counter()
                    outs = llm.generate(inputs, params)
                    rates[name, batch].append(sum(len(o.outputs[0].token_ids) for o in outs)
                                              / (time.perf_counter() - start))
                    outputs[name, batch] = [o.outputs[0].token_ids for o in outs]
            proposed, accepted = (llms["ngram"].engine.spec_counts[i] - before[i] for i in (0, 1))
            counts[batch] = accepted / proposed if proposed else None
        return {(name, b): (statistics.median(r), counts[b] if name == "ngram" else None, outputs[name, b])
                for (name, b), r in rates.items()}
    finally:
        for llm in llms.values():
            llm.shutdown()


def time_transformers(model: str, prompt: list[int], tokens: int, repeats: int, lookup: int | None) -> tuple:
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                  pad_token_id=0)
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    rates = []
    with torch.inference_mode():
        hf.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        for _ in range(repeats):
            start = time.perf_counter()
            out = hf.generate(ids, **kwargs)
            rates.append((out.shape[1] - ids.shape[1]) / (time.perf_counter() - start))
    return statistics.median(rates), out[0, ids.shape[1]:].tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a Qwen3 checkpoint (default: the one described above, built here)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--grounding", type=int, default=256, help="tokens of the model's own continuation in each prompt")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or str(Path(tmp) / "ckpt")
        if not args.checkpoint:
            build(Path(ckpt))
        prompts = grounded_prompts(ckpt, args.batch, 16, args.grounding)
        timed = time_neuron(ckpt, prompts, args.tokens, args.repeats)
        plain = {b: timed["plain", b] for b in (1, args.batch)}
        spec = {b: timed["ngram", b] for b in (1, args.batch)}
        hf_plain = time_transformers(ckpt, prompts[0], args.tokens, args.repeats, None)
        hf_lookup = time_transformers(ckpt, prompts[0], args.tokens, args.repeats, SPEC["num_speculative_tokens"])
    same = all(plain[b][2] == spec[b][2] for b in plain)
    print(f"\nspeculative_config {json.dumps(SPEC)}; greedy outputs equal with and without it: {same}")
    print(f"{'':34} {'batch 1 tok/s':>14} {f'batch {args.batch} tok/s':>15} {'acceptance b1/bN':>18}")
    print(f"{'neuron':34} {plain[1][0]:14.1f} {plain[args.batch][0]:15.1f}")
    acc = "/".join("-" if spec[b][1] is None else f"{spec[b][1]:.0%}" for b in (1, args.batch))
    print(f"{'neuron + ngram':34} {spec[1][0]:14.1f} {spec[args.batch][0]:15.1f} {acc:>18}")
    print(f"{'  ratio':34} {spec[1][0] / plain[1][0]:13.2f}x {spec[args.batch][0] / plain[args.batch][0]:14.2f}x")
    print(f"{'transformers generate':34} {hf_plain[0]:14.1f}")
    print(f"{'transformers prompt_lookup':34} {hf_lookup[0]:14.1f}")
    print(f"{'  neuron + ngram / transformers':34} {spec[1][0] / hf_lookup[0]:13.2f}x")
    print(f"\n{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "spec": SPEC, "outputs_equal": same, "batch": args.batch,
            "neuron": {str(b): plain[b][0] for b in plain}, "neuron_ngram": {str(b): spec[b][0] for b in spec},
            "acceptance": {str(b): spec[b][1] for b in spec},
            "transformers": hf_plain[0], "transformers_prompt_lookup": hf_lookup[0]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
