"""A 16-bit KV cache for an fp32 model on CPU (kv_cache_dtype, vLLM's --kv-cache-dtype): each key
and value is rounded as it is stored and widened as attention reads it, the arithmetic stays fp32.
Against transformers in fp32 throughout, greedy tokens are equal and logprobs within a stated bound,
at tp 1 and 2, with prompts prefilled in several chunks; the pool holds that type, and the same
bytes hold twice the tokens; a type the kernels do not read is refused at start-up."""

from __future__ import annotations

import pytest
import torch
from checkpoints import assert_matches_reference, build_checkpoint, model_config, reference_greedy, shard_spec

from neuron import LLM, SamplingParams
from neuron.engine.model_config import check_kv_cache_dtype
from neuron.errors import ConfigError

# The cache's rounding (a relative 2^-11 for fp16, 2^-8 for bf16 per key and value) moves this
# random checkpoint's logprobs by at most 4.9e-3 (fp16) and 4.1e-2 (bf16), measured over these
# prompts at tp 1 and 2, where an fp32 cache stays within 9e-6; tokens stay equal. The bounds leave
# about twice that; a value widened wrong or stored at the wrong row changes the tokens.
BOUND = {"float16": 1e-2, "bfloat16": 8e-2}
PROMPTS = [[5, 17, 200, 3, 9], list(range(10, 50))]  # the second spans three 16-token prefill chunks
TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("kv16"), seed=4)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_a_16_bit_cache_keeps_transformers_tokens_within_the_bound(checkpoint, tp, kv, small_prefill_chunks):
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, logprobs=5, ignore_eos=True)
    with LLM(str(checkpoint), tensor_parallel_size=tp, device="cpu", dtype="float32", max_model_len=128,
             kv_cache_dtype=kv) as llm:
        cache = llm.engine.executor.rank0.models["model"].model.cache
        assert {t.dtype for t in cache.k + cache.v} == {getattr(torch, kv)}
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    for prompt, got in zip(PROMPTS, outs):
        # (the top 5's membership is not compared: near-ties at the fifth swap under bf16's rounding)
        assert_matches_reference(got, *reference_greedy(checkpoint, prompt, TOKENS), f"{kv} tp {tp}", top=1,
                                 tol=BOUND[kv])


def test_the_same_bytes_hold_twice_the_tokens(checkpoint):
    """A budget given in bytes (kv_cache_memory) buys twice the blocks in 16 bits; left to the
    default, the pool holds max_num_seqs full-length sequences in half the bytes."""
    budget = dict(kv_cache_memory=1 << 20, max_model_len=128)
    wide, narrow = model_config(checkpoint, **budget), model_config(checkpoint, kv_cache_dtype="float16", **budget)
    assert narrow.shard_spec().kv_cache_dtype == "float16" and wide.shard_spec().kv_cache_dtype == ""
    blocks = {}
    for name, config in (("fp32", wide), ("fp16", narrow)):
        with LLM(str(checkpoint), device="cpu", dtype="float32", kv_cache_dtype=config.spec.kv_cache_dtype,
                 **budget) as llm:
            blocks[name] = llm.engine.executor.num_kv_blocks
    assert blocks["fp16"] == 2 * blocks["fp32"]
    default = shard_spec(checkpoint, max_model_len=128, kv_cache_dtype="bfloat16")
    assert default.kv_cache_dtype == "bfloat16"


def test_a_cache_type_the_kernels_do_not_read_is_refused():
    """CUDA's kernels read the model dtype; the CPU kernel that too, and 16-bit keys and values
    under fp32 queries: anything else would leave every step on the slow reference."""
    check_kv_cache_dtype("auto", "auto", "cuda")
    check_kv_cache_dtype("bfloat16", "auto", "cuda:0")  # the model dtype there
    check_kv_cache_dtype("float16", "float32", "cpu")
    check_kv_cache_dtype("bfloat16", "auto", "cpu")  # auto is float32 on CPU
    check_kv_cache_dtype("bfloat16", "bfloat16", "cpu")
    with pytest.raises(ConfigError, match="kv_cache_dtype float16 differs from the model dtype bfloat16"):
        check_kv_cache_dtype("float16", "auto", "cuda")
    for kv, model in (("float32", "bfloat16"), ("float16", "bfloat16"), ("bfloat16", "float16")):
        with pytest.raises(ConfigError, match=f"kv_cache_dtype {kv} with the model dtype {model}"):
            check_kv_cache_dtype(kv, model, "cpu")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        model_config(None, kv_cache_dtype="float8")  # not a type it knows
