"""`neuron generate`: one-off generation through the offline API."""

from __future__ import annotations

import sys

from neuron.entrypoints.options import add_model, add_options

# The settings `neuron generate` takes as flags; the rest come from the environment or the defaults.
OPTIONS = ("tp", "device", "dtype", "quantization", "max_model_len", "max_num_seqs", "kv_cache_memory",
           "kv_cache_dtype", "gpu_memory_utilization", "no_prefix_caching")


def add_parser(sub) -> None:
    ap = sub.add_parser("generate", help="generate text offline (no server)",
                        description="Generate from one or more prompts with the offline API and print the text.")
    add_model(ap)
    ap.add_argument("-p", "--prompt", action="append",
                    help="prompt text, repeatable (default: \"Hello, my name is\")")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    add_options(ap, OPTIONS)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    ap.set_defaults(run=run)


def run(args) -> int:
    """0 on success; 2 for what the user must change (the model, a setting, a prompt), 1 when
    generation itself fails. Either way one line on stderr, as `neuron serve` prints."""
    from neuron.engine.llm_engine import RequestError
    from neuron.engine.sampling_params import InvalidParams
    from neuron.errors import ConfigError, NeuronError

    try:
        return _generate(args)
    except (ConfigError, RequestError, InvalidParams) as exc:
        print(f"neuron generate: {exc}", file=sys.stderr)
        return 2
    except NeuronError as exc:
        print(f"neuron generate: {exc}", file=sys.stderr)
        return 1


def _generate(args) -> int:
    from neuron import LLM, SamplingParams
    from neuron.utils.log import setup_logging

    prompts = args.prompt or ["Hello, my name is"]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    setup_logging()
    llm = LLM(args.model, tensor_parallel_size=args.tp, device=args.device, dtype=args.dtype,
              quantization=args.quantization,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
              gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=False if args.no_prefix_caching else None)
    with llm:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params) if args.chat \
            else llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        sys.stdout.write(f"--- {prompt!r} ({len(c.token_ids)} tokens, {c.finish_reason})\n{c.text}\n")
    return 0
