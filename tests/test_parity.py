"""Greedy tokens and logprobs through the offline API equal transformers' at several tp sizes."""

from __future__ import annotations

import pytest
from checkpoints import assert_chunking_changes_nothing, assert_matches_reference, reference_greedy

from neuron import LLM, SamplingParams

NEW_TOKENS = 8
# Unequal prompts; the 40-token one spans several prefill chunks (NEURON_PREFILL_CHUNK_TOKENS=16).
PROMPTS = [[5, 17, 200, 3], list(range(10, 50)), [7], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]

pytestmark = pytest.mark.usefixtures("small_prefill_chunks")


def _check(llm: LLM, checkpoint) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        got = out.outputs[0]
        assert_matches_reference(got, *reference_greedy(checkpoint, prompt, NEW_TOKENS), f"prompt {prompt[:5]}...")
        assert got.finish_reason == "length"
        assert len(got.logprobs) == NEW_TOKENS
        assert all(token in lp for token, lp in zip(got.token_ids, got.logprobs))


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_odd_checkpoint(odd_checkpoint, tp):
    """vocab 301 (no tp divides it), one KV head replicated, head_dim 24 != 64/4, untied. Through
    the default attention: each step one flat batch, KV blocks read in place (the C++ kernel)."""
    with LLM(str(odd_checkpoint), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        assert llm.engine.executor.rank0.models["model"].model.cache.paged
        _check(llm, odd_checkpoint)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_tied_checkpoint(tied_checkpoint, tp):
    with LLM(str(tied_checkpoint), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        _check(llm, tied_checkpoint)


def test_chunked_prefill_equals_single_shot(odd_checkpoint, monkeypatch):
    """The same prompt prefilled in 3-token chunks and in one shot gives identical logprobs."""
    assert_chunking_changes_nothing(odd_checkpoint, PROMPTS[1], 3, monkeypatch)


@pytest.mark.slow
def test_batch_equals_alone(odd_checkpoint):
    """A prompt's tokens do not depend on what else is in the batch (slots never mix)."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(odd_checkpoint), tensor_parallel_size=2, device="cpu", dtype="float32", max_num_seqs=2) as llm:
        together = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        alone = [llm.generate({"prompt_token_ids": p}, params)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_gather_reference_path(odd_checkpoint, tp, monkeypatch):
    """NEURON_ATTENTION=gather, the reference path that copies each context out of the pool for
    SDPA, equals transformers too."""
    monkeypatch.setenv("NEURON_ATTENTION", "gather")
    with LLM(str(odd_checkpoint), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        assert not llm.engine.executor.rank0.models["model"].model.cache.paged
        _check(llm, odd_checkpoint)
