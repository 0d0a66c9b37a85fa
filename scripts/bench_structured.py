"""What structured output costs a decode step: the engine's batched step at batch 64 with a grammar
mask on every sequence, against the same step without, same checkpoint, same run.

    python scripts/bench_structured.py                      # embedded default model, CPU, batch 64
    python scripts/bench_structured.py --steps 300 --greedy --json-out out.json

Two engines run side by side, one whose sequences all decode into a JSON schema (an array of short
records whose minItems keeps the grammar open for the whole run, so the batch stays full) and one
whose sequences decode freely with the same sampling settings. Their steps alternate, so both see
the same machine (a shared CPU's load drifts). Prints the median step time of each, their ratio
(with masks / without), and the median of the step-by-step ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

SCHEMA = {
    "type": "array",
    "minItems": 500,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "score": {"type": "number"},
        },
        "required": ["id", "name", "tags", "score"],
        "additionalProperties": False,
    },
}
PROMPT = "List the records as JSON."


def engine(batch: int):
    from neuron.engine.llm_engine import EngineConfig, LLMEngine

    cfg = EngineConfig(device="cpu", dtype="float32", max_num_seqs=batch, max_model_len=2048)
    return LLMEngine(cfg).start()


def fill(llm, batch: int, guided, greedy: bool, tokens: int) -> None:
    """Admit a full batch and prefill it: after this, every step decodes one token per sequence."""
    from neuron import SamplingParams

    sampling = {"temperature": 0.0} if greedy else llm.default_sampling()
    params = SamplingParams(**sampling, max_tokens=tokens, ignore_eos=True, seed=0)
    for i in range(batch):
        llm.add_request(str(i), llm.tokenizer.encode(f"{PROMPT} ({i})"), params, grammar=guided)
    while not (len(llm.scheduler.running) == batch
               and all(s.num_computed == s.num_tokens - 1 for s in llm.scheduler.running)):
        llm.step()


def timed_step(llm, batch: int) -> float:
    t0 = time.perf_counter()
    updates = llm.step()
    elapsed = time.perf_counter() - t0
    ended = [u for u in updates if u.finished]
    if len(updates) != batch or ended:
        why = f"{ended[0].finish_reason} {ended[0].error or ''}" if ended else f"{len(updates)} updates"
        raise RuntimeError(f"the batch did not stay full ({why})")
    return elapsed


def measure(args) -> dict:
    from neuron.engine.sampling_params import GuidedDecodingParams

    plain_llm, masked_llm = engine(args.batch), engine(args.batch)
    try:
        t0 = time.perf_counter()
        grammar = masked_llm.structured.compile(GuidedDecodingParams(json=SCHEMA))
        compile_ms = (time.perf_counter() - t0) * 1e3
        tokens = args.warmup + args.steps + 8  # the batch never reaches max_tokens
        fill(plain_llm, args.batch, None, args.greedy, tokens)
        fill(masked_llm, args.batch, grammar, args.greedy, tokens)
        plain, masked = [], []
        for k in range(args.warmup + args.steps):
            times = timed_step(plain_llm, args.batch), timed_step(masked_llm, args.batch)
            if k >= args.warmup:
                plain.append(times[0])
                masked.append(times[1])
    finally:
        plain_llm.shutdown()
        masked_llm.shutdown()
    return {"plain_ms": statistics.median(plain) * 1e3, "masked_ms": statistics.median(masked) * 1e3,
            "paired_ratio": statistics.median(m / p for p, m in zip(plain, masked)), "compile_ms": compile_ms}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps of each engine")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--greedy", action="store_true", help="argmax instead of the model's sampling settings")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    result = measure(args)
    result |= {"batch": args.batch, "steps": args.steps, "mode": "greedy" if args.greedy else "sampled",
               "ratio": result["masked_ms"] / result["plain_ms"], "torch_threads": torch.get_num_threads()}
    print(f"embedded default model, CPU ({platform.machine()}, {result['torch_threads']} torch threads), "
          f"batch {args.batch}, {result['mode']}, {args.steps} steps each")
    print(f"  grammar compile (uncached): {result['compile_ms']:.1f} ms")
    print(f"  decode step without masks: {result['plain_ms']:.2f} ms (median)")
    print(f"  decode step with masks:    {result['masked_ms']:.2f} ms (median)")
    print(f"  ratio with / without: {result['ratio']:.3f}; median of step-by-step ratios: "
          f"{result['paired_ratio']:.3f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
