"""`neuron generate`: one-off generation through the offline API."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    ap = sub.add_parser("generate", help="generate text offline (no server)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                        description="Generate from one or more prompts with the offline API and print the text.")
    ap.add_argument("model", nargs="?", default=None, help="checkpoint directory or HF repo id in the local cache; "
                    "omitted: the embedded tiny default (random weights: its words are noise)")
    ap.add_argument("-p", "--prompt", action="append", help="prompt text (repeatable)")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    ap.add_argument("--kv-cache-memory", default=None,
                    help="KV cache per rank, bytes or with a unit (4GiB); default: free GPU memory on CUDA, "
                         "room for every sequence at full length on CPU")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="share of each GPU's memory neuron may use (default 0.9)")
    ap.add_argument("--no-prefix-caching", action="store_true", help="recompute shared prompt prefixes")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.set_defaults(run=run)


def run(args) -> int:
    from neuron import LLM, SamplingParams
    from neuron.utils.log import setup_logging

    setup_logging()
    prompts = args.prompt or ["Hello, my name is"]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    with LLM(args.model, tensor_parallel_size=args.tp, device=args.device, dtype=args.dtype,
             kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
             enable_prefix_caching=False if args.no_prefix_caching else None) as llm:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params) if args.chat \
            else llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        sys.stdout.write(f"--- {prompt!r} ({len(c.token_ids)} tokens, {c.finish_reason})\n{c.text}\n")
    return 0
