"""Prompt log-probabilities (SamplingParams.prompt_logprobs, the server's echo with logprobs)
equal transformers' log-softmax over the prompt, across prefill chunks and tp sizes."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from checkpoints import cached_model
from server_harness import LiveServer, real_engine

from neuron import LLM, SamplingParams
from neuron.models import prompt_logprobs

# The 40-token prompt spans several 16-token prefill chunks; the 1-token one has only its None.
PROMPTS = [list(range(10, 50)), [5, 17, 200, 3], [7]]
TOP = 3


def reference_prompt_logprobs(path, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each prompt position ([len(prompt), vocab])."""
    from transformers import Qwen3ForCausalLM

    model = cached_model(Qwen3ForCausalLM, path)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long)).logits
    return torch.log_softmax(logits[0].float(), -1)


def reference_ranks(row: torch.Tensor, token: int) -> range:
    """The ranks `token` may take in `row` (transformers' logprobs at a position): one more than the
    tokens more likely, give or take those within float error of it."""
    own = row[token]
    return range(int((row > own + 1e-4).sum()) + 1, int((row > own - 1e-4).sum()) + 1)


def check_against_reference(path, prompt: list[int], got: list, top: int) -> None:
    ref = reference_prompt_logprobs(path, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        entry, row = got[pos], ref[pos - 1]
        assert prompt[pos] in entry
        for tid, value in entry.items():
            assert abs(value - row[tid].item()) <= 1e-3, (pos, tid)
        assert set(row.topk(top).indices.tolist()) <= set(entry)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_prompt_logprobs_equal_transformers(odd_checkpoint, tp, monkeypatch):
    monkeypatch.setenv("NEURON_PREFILL_CHUNK_TOKENS", "16")
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP, ignore_eos=True)
    with LLM(str(odd_checkpoint), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs):
        check_against_reference(odd_checkpoint, prompt, out.prompt_logprobs, TOP)
        assert len(out.outputs[0].token_ids) == 2


def test_max_tokens_zero_scores_the_prompt_only(odd_checkpoint, monkeypatch):
    """max_tokens 0: the request ends after its prefill ("length"), nothing generated; the
    prefix cache does not skip a prompt seen before (its logprobs would be missing)."""
    monkeypatch.setenv("NEURON_PREFILL_CHUNK_TOKENS", "16")
    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_PASS", 6)  # several LM-head passes per chunk (one rank only)
    params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=0)
    with LLM(str(odd_checkpoint), device="cpu", dtype="float32") as llm:
        first = llm.generate({"prompt_token_ids": PROMPTS[0]}, params)[0]
        again = llm.generate({"prompt_token_ids": PROMPTS[0]}, params)[0]
    for out in (first, again):
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        check_against_reference(odd_checkpoint, PROMPTS[0], out.prompt_logprobs, 0)
        assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # top 0: the prompt's own token only


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_prompt_token_ranks_equal_transformers(odd_checkpoint, tp, monkeypatch):
    """Each prompt token's rank is its rank in the whole vocabulary (vLLM's Logprob.rank), not among
    the top-k: from the chunks' rows and from the rows that end a chunk alike, the vocabulary split
    across ranks at tp 2."""
    monkeypatch.setenv("NEURON_PREFILL_CHUNK_TOKENS", "16")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    with LLM(str(odd_checkpoint), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, params)[0]
    ref = reference_prompt_logprobs(odd_checkpoint, PROMPTS[0])
    assert len(out.prompt_token_ranks) == len(PROMPTS[0]) and out.prompt_token_ranks[0] is None
    for pos in range(1, len(PROMPTS[0])):
        assert out.prompt_token_ranks[pos] in reference_ranks(ref[pos - 1], PROMPTS[0][pos]), pos


# ---- over HTTP, as evaluation harnesses send it ----


@pytest.fixture(scope="module")
def odd_server(odd_checkpoint):
    with LiveServer(real_engine(str(odd_checkpoint), 1, name="odd", prefill_chunk_tokens=16)) as server:
        yield server.wait_ready()


def test_lm_eval_loglikelihood_request(odd_server, odd_checkpoint):
    """lm-eval's local-completions scores contexts and continuations so: token-id prompts batched
    in one request, echo, logprobs 1, max_tokens 0, temperature 0. Each choice echoes its prompt
    with one logprob per token, the first null, equal to transformers'."""
    prompts = [PROMPTS[0], PROMPTS[1]]
    body = {"model": "odd", "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0.0,
            "seed": 1234}
    r = httpx.post(f"{odd_server.base_url}/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for prompt, choice in zip(prompts, choices):
        lp = choice["logprobs"]
        assert choice["finish_reason"] == "length"
        assert lp["tokens"] == [f"token_id:{t}" for t in prompt]  # no tokenizer: ids
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = reference_prompt_logprobs(odd_checkpoint, prompt)
        for pos in range(1, len(prompt)):
            assert abs(lp["token_logprobs"][pos] - ref[pos - 1, prompt[pos]].item()) <= 1e-3
            best = int(ref[pos - 1].argmax())
            assert f"token_id:{best}" in lp["top_logprobs"][pos]  # lm-eval's is_greedy check
    assert r.json()["usage"]["completion_tokens"] == 0


def test_vllm_prompt_logprobs_field(odd_server, odd_checkpoint):
    """vLLM's `prompt_logprobs` request field: a list on the choice, None first, then {id: {logprob, rank}}."""
    body = {"model": "odd", "prompt": PROMPTS[1], "prompt_logprobs": 2, "max_tokens": 1, "temperature": 0.0}
    r = httpx.post(f"{odd_server.base_url}/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    ref = reference_prompt_logprobs(odd_checkpoint, PROMPTS[1])
    assert len(got) == len(PROMPTS[1]) and got[0] is None
    for pos in range(1, len(PROMPTS[1])):
        own = got[pos][str(PROMPTS[1][pos])]
        assert abs(own["logprob"] - ref[pos - 1, PROMPTS[1][pos]].item()) <= 1e-3
        assert {v["rank"] for v in got[pos].values()} >= {1, 2}
    bad = httpx.post(f"{odd_server.base_url}/completions", json={**body, "prompt_logprobs": -1}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_vllm_prompt_logprobs_ranks_count_the_whole_vocabulary(odd_server, odd_checkpoint):
    """vLLM's `prompt_logprobs` ranks: the prompt's own token's in the whole vocabulary, the top-k's
    1..k, at every position of a prompt that spans prefill chunks."""
    body = {"model": "odd", "prompt": PROMPTS[0], "prompt_logprobs": 2, "max_tokens": 0, "temperature": 0.0}
    r = httpx.post(f"{odd_server.base_url}/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    ref = reference_prompt_logprobs(odd_checkpoint, PROMPTS[0])
    for pos in range(1, len(PROMPTS[0])):
        row, own = ref[pos - 1], PROMPTS[0][pos]
        assert got[pos][str(own)]["rank"] in reference_ranks(row, own), pos
        best = row.topk(2).indices.tolist()
        assert [got[pos][str(t)]["rank"] for t in best] == [1, 2], pos


def test_echo_continues_after_the_prompt(clients_server_default):
    """echo with max_tokens > 0 through the official client: the text is the prompt then the
    completion, and the logprobs cover both, offsets counting characters of that text."""
    client = openai.OpenAI(base_url=clients_server_default.base_url, api_key="unused")
    r = client.completions.create(model="neuron-default", prompt="The capital of France is", echo=True,
                                  logprobs=2, max_tokens=4, temperature=0.0)
    choice = r.choices[0]
    assert choice.text.startswith("The capital of France is")
    lp = choice.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    plain = client.completions.create(model="neuron-default", prompt="The capital of France is", max_tokens=4,
                                      temperature=0.0)
    assert choice.text == "The capital of France is" + plain.choices[0].text


@pytest.fixture(scope="module")
def clients_server_default():
    with LiveServer(real_engine(None, 1, max_model_len=512)) as server:
        yield server.wait_ready()


def test_streamed_echo_starts_with_the_prompt(odd_server, odd_checkpoint):
    """Streaming: the first chunk carries the echoed prompt's logprobs, then the completion's follow."""
    body = {"model": "odd", "prompt": PROMPTS[1], "echo": True, "logprobs": 1, "max_tokens": 2, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    tokens, values = [], []
    with httpx.stream("POST", f"{odd_server.base_url}/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    if choice["logprobs"]:
                        tokens += choice["logprobs"]["tokens"]
                        values += choice["logprobs"]["token_logprobs"]
    assert tokens[: len(PROMPTS[1])] == [f"token_id:{t}" for t in PROMPTS[1]]
    assert len(tokens) == len(PROMPTS[1]) + 2 and values[0] is None
    ref = reference_prompt_logprobs(odd_checkpoint, PROMPTS[1])
    assert abs(values[1] - ref[0, PROMPTS[1][1]].item()) <= 1e-3
