"""Speculative decoding on CPU: neuron without it and with each proposer (n-gram, suffix, draft
model), and transformers' prompt-lookup and assisted (draft-model) decoding, on the same
checkpoint and prompts in one run.

    python scripts/bench_spec.py                      # builds its checkpoints in a temporary folder
    python scripts/bench_spec.py --tokens 96 --repeats 3 --json-out out.json

The workload is input-grounded the way a random-weight model allows: the checkpoint (the 191M
benchmark's layer shape, 16 layers deep, 380M, with a 512-token vocabulary) falls into runs of
repeated tokens, and each prompt is
a seed followed by the model's own greedy continuation of it, so what the model generates next
repeats spans it has already seen, as summaries and code edits repeat their inputs. Greedy, EOS
ignored; batch 1 (one prompt) and batch 32 (32 prompts at once); the medians of --repeats runs. The
acceptance rate is neuron's (accepted / proposed tokens) over the timed runs.

The draft/target pair is built to agree: the target's layers past the second write a tenth of what
random weights would (their output projections scaled by 0.1), so it computes all 16 layers but
mostly says what its first two say; the draft is those two layers with the same embeddings and
head (an eighth of the target's weights, as a 1B draft is of an 8B target). The suffix proposer
runs without its cache of earlier outputs, since every round repeats the same prompts and that
cache would hold their answers.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from checkpoints import truncated_copy  # noqa: E402

SHAPE = dict(vocab_size=512, hidden_size=1024, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128)
MAX_LEN = 512
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_cached_requests": 0}
DRAFT_LAYERS, QUIET = 2, 0.1


def build(path: Path, layers: int) -> None:
    """The target: random narrow weights, its layers past DRAFT_LAYERS quietened (see above)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**dict(SHAPE, num_hidden_layers=layers), max_position_embeddings=4096, tie_word_embeddings=False,
                      initializer_range=0.02,
                      eos_token_id=None, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers[DRAFT_LAYERS:]:
            layer.self_attn.o_proj.weight.mul_(QUIET)
            layer.mlp.down_proj.weight.mul_(QUIET)
    model.save_pretrained(path, safe_serialization=True)


def variants(draft: str) -> dict:
    return {"plain": None, "ngram": SPEC, "suffix": SUFFIX,
            "draft": {"method": "draft", "model": draft, "num_speculative_tokens": 3}}


def grounded_prompts(model: str, count: int, seed_len: int, grounding: int) -> list[list[int]]:
    """Seeds and the model's own greedy continuation of each (what the next tokens will repeat)."""
    from neuron import LLM, SamplingParams

    seeds = [[(37 * i + 13 * j) % SHAPE["vocab_size"] for j in range(seed_len)] for i in range(count)]
    with LLM(model, device="cpu", dtype="float32", max_num_seqs=count, max_model_len=MAX_LEN) as llm:
        outs = llm.generate([{"prompt_token_ids": s} for s in seeds],
                            SamplingParams(temperature=0.0, max_tokens=grounding, ignore_eos=True))
    return [s + o.outputs[0].token_ids for s, o in zip(seeds, outs)]


def _counts(llm) -> tuple[int, int, int]:
    """The engine's cumulative speculative counts: proposed, accepted, sequence-steps."""
    if llm.engine.spec is None:  # the plain variant
        return 0, 0, 0
    c = llm.engine.spec.counts
    return c.proposed, c.accepted, c.steps


def time_neuron(model: str, draft: str, prompts: list[list[int]], tokens: int, repeats: int) -> dict:
    """Without and with each proposer, all loaded at once and run in turn, round after round (the
    VM's speed drifts): per variant and batch size, (median tok/s, acceptance, outputs)."""
    from neuron import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llms = {name: LLM(model, device="cpu", dtype="float32", max_num_seqs=len(prompts), max_model_len=MAX_LEN,
                      speculative_config=spec) for name, spec in variants(draft).items()}
    try:
        rates = {(name, b): [] for name in llms for b in (1, len(prompts))}
        counts, outputs = {}, {}
        for llm in llms.values():
            llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(temperature=0.0, max_tokens=4))
        for batch in (1, len(prompts)):
            inputs = [{"prompt_token_ids": p} for p in prompts[:batch]]
            before = {name: _counts(llm) for name, llm in llms.items()}
            for _ in range(repeats):
                for name, llm in llms.items():
                    start = time.perf_counter()
                    outs = llm.generate(inputs, params)
                    rates[name, batch].append(sum(len(o.outputs[0].token_ids) for o in outs)
                                              / (time.perf_counter() - start))
                    outputs[name, batch] = [o.outputs[0].token_ids for o in outs]
            for name, llm in llms.items():
                proposed, accepted = (now - then for now, then in zip(_counts(llm)[:2], before[name][:2]))
                counts[name, batch] = accepted / proposed if proposed else None
        return {(name, b): (statistics.median(r), counts[name, b], outputs[name, b]) for (name, b), r in rates.items()}
    finally:
        for llm in llms.values():
            llm.shutdown()


def time_transformers(model: str, prompt: list[int], tokens: int, repeats: int, lookup: int | None = None,
                      draft: str | None = None) -> tuple:
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                  pad_token_id=0)
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    if draft:
        kwargs["assistant_model"] = Qwen3ForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
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
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"],
                    help=f"the built target's depth (the draft is its first {DRAFT_LAYERS})")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or str(Path(tmp) / "ckpt")
        if not args.checkpoint:
            build(Path(ckpt), args.layers)
        draft = str(truncated_copy(Path(ckpt), Path(tmp) / "draft", DRAFT_LAYERS))
        prompts = grounded_prompts(ckpt, args.batch, 16, args.grounding)
        timed = time_neuron(ckpt, draft, prompts, args.tokens, args.repeats)
        hf = {"generate": time_transformers(ckpt, prompts[0], args.tokens, args.repeats),
              "prompt_lookup": time_transformers(ckpt, prompts[0], args.tokens, args.repeats,
                                                 lookup=SPEC["num_speculative_tokens"]),
              "assistant_model": time_transformers(ckpt, prompts[0], args.tokens, args.repeats, draft=draft)}
    batches = (1, args.batch)
    plain = {b: timed["plain", b] for b in batches}
    same = all(timed[name, b][2] == plain[b][2] for name in variants("") for b in batches)
    print(f"\ngreedy outputs equal with and without speculation, every proposer and batch: {same}")
    print(f"{'':34} {'batch 1 tok/s':>14} {f'batch {args.batch} tok/s':>15} {'vs none b1/bN':>15} "
          f"{'acceptance b1/bN':>18}")
    for name in variants(""):
        rate = {b: timed[name, b][0] for b in batches}
        ratio = "/".join(f"{rate[b] / plain[b][0]:.2f}x" for b in batches)
        acc = "/".join("-" if timed[name, b][1] is None else f"{timed[name, b][1]:.0%}" for b in batches)
        label = "neuron" if name == "plain" else f"neuron + {name}"
        print(f"{label:34} {rate[1]:14.1f} {rate[args.batch]:15.1f} {ratio:>15} {acc:>18}")
    for name, (rate, _) in hf.items():
        print(f"{'transformers ' + name:34} {rate:14.1f}")
    print(f"{'  neuron + ngram / prompt_lookup':34} {timed['ngram', 1][0] / hf['prompt_lookup'][0]:13.2f}x")
    print(f"{'  neuron + draft / assistant_model':34} {timed['draft', 1][0] / hf['assistant_model'][0]:13.2f}x")
    print(f"\n{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "variants": variants("draft"), "outputs_equal": same, "batch": args.batch,
            "neuron": {name: {str(b): timed[name, b][0] for b in batches} for name in variants("")},
            "acceptance": {name: {str(b): timed[name, b][1] for b in batches} for name in variants("")},
            "transformers": {name: rate for name, (rate, _) in hf.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
