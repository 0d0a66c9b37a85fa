"""Beam search (engine/beam_search.py) as vLLM offers it: `LLM.beam_search` and `use_beam_search`
on the server, equal to transformers' beam search on a random checkpoint at tp 1 and 2; the
search's own rules (EOS, length penalty, the context) on made-up log-probabilities."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from checkpoints import build_checkpoint, cached_model
from server_harness import LiveServer, client, real_engine

from neuron import LLM, BeamSearchParams
from neuron.engine.beam_search import BeamSearch
from neuron.engine.sampling_params import InvalidParams

PROMPT = [5, 17, 20, 3, 9]
WIDTH, STEPS = 3, 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("beams"), seed=11)


def reference_beams(path, prompt: list[int], width: int, steps: int) -> list[tuple[list[int], float]]:
    """transformers' beam search: each returned beam's generated tokens and its score (cumulative
    log-probability over generated length), best first. No EOS, so every beam runs `steps` tokens."""
    from transformers import Qwen3ForCausalLM

    ids = torch.tensor([prompt])
    out = cached_model(Qwen3ForCausalLM, path).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False, num_beams=width,
        num_return_sequences=width, output_scores=True, return_dict_in_generate=True, eos_token_id=None,
        pad_token_id=0, length_penalty=1.0)
    return [(seq[len(prompt):].tolist(), float(score)) for seq, score in zip(out.sequences, out.sequences_scores)]


@pytest.mark.parametrize("tp", [1, 2])
def test_offline_beam_search_equals_transformers(checkpoint, tp):
    want = reference_beams(checkpoint, PROMPT, WIDTH, STEPS)
    with LLM(str(checkpoint), tensor_parallel_size=tp, device="cpu", dtype="float32", max_model_len=64) as llm:
        [out] = llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(WIDTH, STEPS, ignore_eos=True))
    assert len(out.sequences) == WIDTH
    for beam, (tokens, score) in zip(out.sequences, want):
        assert beam.tokens == PROMPT + tokens and beam.finish_reason == "length"
        assert beam.cum_logprob / STEPS == pytest.approx(score, abs=1e-4)
        assert len(beam.logprobs) == STEPS and all(len(top) >= 2 * WIDTH for top in beam.logprobs)


def test_use_beam_search_on_the_server(beam_server, default_tokenizer):
    """/v1/completions' n best beams equal transformers'; what beam search cannot take is a 400
    naming the field."""
    from neuron.utils.default_checkpoint import default_model_dir

    want = reference_beams(default_model_dir(), PROMPT, 2, 4)
    out = client(beam_server).completions.create(model="neuron-default", prompt=PROMPT, n=2, max_tokens=4,
                                                 extra_body={"use_beam_search": True, "ignore_eos": True})
    assert out.usage.prompt_tokens == len(PROMPT) and out.usage.completion_tokens == 8
    assert [(c.text, c.finish_reason) for c in out.choices] == [(default_tokenizer.decode(tokens), "length")
                                                               for tokens, _ in want]
    echoed = client(beam_server).completions.create(model="neuron-default", prompt=PROMPT, n=2, max_tokens=4,
                                                    echo=True, extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.text for c in echoed.choices] == [default_tokenizer.decode(PROMPT, skip_special_tokens=False) + c.text
                                                for c in out.choices]
    for field, value in (("stream", True), ("top_p", 0.5), ("logprobs", 2), ("stop", ["x"]), ("seed", 3)):
        r = httpx.post(f"{beam_server.url}/v1/completions", json={
            "model": "neuron-default", "prompt": PROMPT, "n": 2, "use_beam_search": True, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert f"use_beam_search does not take {field}" in r.json()["error"]["message"]
    r = httpx.post(f"{beam_server.url}/v1/completions", json={"model": "neuron-default", "prompt": PROMPT, "n": 11,
                                                              "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_a_chats_beams_are_the_beams_of_its_prompt(beam_server, default_tokenizer):
    """A chat's beams are the beams of its rendered prompt, each read as a chat reply."""
    from neuron.entrypoints.openai.response_parser import OutputParser

    messages = [{"role": "user", "content": "Name a river."}]
    switch = {"chat_template_kwargs": {"enable_thinking": False}}
    chat = client(beam_server).chat.completions.create(model="neuron-default", messages=messages, n=2, max_tokens=5,
                                                       extra_body={"use_beam_search": True, **switch})
    ids = httpx.post(f"{beam_server.url}/tokenize", json={"model": "neuron-default", "messages": messages,
                                                          **switch}).json()["tokens"]
    plain = client(beam_server).completions.create(model="neuron-default", prompt=ids, n=2, max_tokens=5,
                                                   extra_body={"use_beam_search": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage == plain.usage
    prompt = default_tokenizer.decode(ids, skip_special_tokens=False)
    replies = []
    for c in plain.choices:  # each beam's text read as a chat reply is read (reasoning apart)
        parser = OutputParser.for_chat(default_tokenizer, prompt, tools=None)
        parsed = parser.feed(c.text)
        parsed.extend(parser.finish())
        replies.append(("assistant", parsed.content if parsed.content or not parsed.reasoning else None,
                        parsed.reasoning or None, c.finish_reason))
    assert [(c.message.role, c.message.content, c.message.model_extra.get("reasoning_content"), c.finish_reason)
            for c in chat.choices] == replies


@pytest.fixture(scope="module")
def beam_server():
    with LiveServer(real_engine(None, 1, max_model_len=256)) as server:
        yield server.wait_ready()


# ---- the search's own rules ----


def test_an_eos_ends_a_beam_and_the_length_penalty_ranks_the_ends():
    """A beam that reaches EOS leaves the search; at the end complete and live beams are ranked by
    cumulative log-probability over generated length to the power length_penalty."""
    eos = 99
    search = BeamSearch([1, 2], BeamSearchParams(2, 3, length_penalty=1.0), [eos], max_model_len=100)
    search.advance([{eos: math.log(0.5), 10: math.log(0.3), 11: math.log(0.2)}])
    assert [b.tokens for b in search.completed] == [[1, 2, eos]]
    assert [b.tokens for b in search.beams] == [[1, 2, 10], [1, 2, 11]]
    search.advance([{12: math.log(0.9)}, {13: math.log(0.4)}])
    search.advance([{14: math.log(0.9)}, {15: math.log(0.9)}])
    assert search.done
    best = search.best()
    # log(0.5) / 1 = -0.69 ranks below log(0.3 * 0.9 * 0.9) / 3 = -0.47
    assert [b.tokens for b in best] == [[1, 2, 10, 12, 14], [1, 2, eos]]
    assert [b.finish_reason for b in best] == ["length", "stop"] and best[1].stop_reason == eos
    assert search.output_ids(best[1]) == []  # the EOS is not in the text unless asked for
    zero = BeamSearch([1, 2], BeamSearchParams(2, 3, length_penalty=0.0), [eos], max_model_len=100)
    zero.completed, zero.beams = search.completed, search.beams
    assert zero.best()[0].tokens == [1, 2, eos]  # no length penalty: the highest sum wins
    huge = BeamSearch([1, 2], BeamSearchParams(2, 3, length_penalty=1e308), [eos], max_model_len=100)
    huge.completed, huge.beams = search.completed, search.beams
    assert huge.best()[0].tokens == [1, 2, 10, 12, 14]  # no overflow: the longer beam, by far


def test_the_context_bounds_the_steps_and_the_params_are_checked():
    search = BeamSearch(list(range(10)), BeamSearchParams(2, 50), [], max_model_len=12)
    assert search.steps_left == 2
    for width in (0, 11, True):
        with pytest.raises(InvalidParams, match="beam_width must be an integer in"):
            BeamSearchParams(width, 4)
    with pytest.raises(InvalidParams, match="length_penalty must be a finite number"):
        BeamSearchParams(2, 4, length_penalty=float("nan"))
    with pytest.raises(InvalidParams, match="max_tokens must be an integer >= 1"):
        BeamSearchParams(2, 0)
