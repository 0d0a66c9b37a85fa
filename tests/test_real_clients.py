"""What real clients send: several samples (`n`, `best_of`), batched prompts, vLLM's /tokenize and
/detokenize, and the details they check (logprob bytes, no empty `tool_calls`), through the official
openai client on a live server with the embedded default model; the CLI's one-line errors."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_harness import LiveServer, client, metric, real_engine, token_ids

from neuron import LLM, SamplingParams
from neuron.entrypoints.cli import run_command

MAX_MODEL_LEN = 1024
BLOCK_SIZE = 16  # the default NEURON_KV_BLOCK_SIZE
MODEL = "neuron-default"
SAMPLED = {"temperature": 1.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
GREEDY = {"temperature": 0.0, "max_tokens": 4, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def clients_server():
    with LiveServer(real_engine(None, 1, max_model_len=MAX_MODEL_LEN)) as server:
        yield server.wait_ready()


def _as_ids(**kw) -> dict:
    """Completion arguments that return each sampled token's id and logprob."""
    extra = {**kw.pop("extra_body", {}), "return_tokens_as_token_ids": True}
    return {**kw, "logprobs": 0, "extra_body": extra}


def _sampled_ids(choice) -> list[int]:
    return token_ids(choice.logprobs)


# ---- n and best_of ----


def test_n_with_a_seed_is_seed_plus_i_per_sample(clients_server, default_tokenizer):
    c = client(clients_server)
    kw = _as_ids(model=MODEL, prompt="The river bends", n=3, seed=11, **SAMPLED)
    out = c.completions.create(**kw)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    samples = [_sampled_ids(ch) for ch in out.choices]
    assert [_sampled_ids(ch) for ch in c.completions.create(**kw).choices] == samples  # deterministic
    assert len({tuple(s) for s in samples}) == 3
    for i, sample in enumerate(samples):
        alone = c.completions.create(**{**kw, "n": 1, "seed": 11 + i})
        assert _sampled_ids(alone.choices[0]) == sample
    prompt_len = len(default_tokenizer.encode("The river bends"))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_len, 24)  # the prompt counted once
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3, seed=11,
                                     **SAMPLED)
    assert [ch.index for ch in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens == 24


def test_the_prompt_is_prefilled_once_for_n_samples(clients_server):
    prompt = [(37 * i + 5) % 1300 + 3 for i in range(40)]  # met nowhere else, so nothing of it is cached yet
    engine = clients_server.engine.engine
    before = engine.prefix_cache_counts()
    out = client(clients_server).completions.create(model=MODEL, prompt=prompt, n=3, seed=1, **SAMPLED)
    queries, hits = (a - b for a, b in zip(engine.prefix_cache_counts(), before))
    # The first sample computes all 40 tokens; the others take its two full blocks from the cache
    # and compute only the last, partial one (8 tokens each).
    assert (queries, hits) == (3 * 40, 2 * 2 * BLOCK_SIZE)
    assert out.usage.prompt_tokens == 40


def test_n_streaming_chunks_carry_every_index(clients_server):
    c = client(clients_server)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about rivers."}], n=2, seed=3, **SAMPLED)
    whole = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    choices = [ch.choices[0] for ch in chunks if ch.choices]
    assert all(len(ch.choices) == 1 for ch in chunks if ch.choices)
    assert [ch.index for ch in choices[:2]] == [0, 1] and all(ch.delta.role == "assistant" for ch in choices[:2])
    for i in (0, 1):
        mine = [ch for ch in choices if ch.index == i]
        assert "".join(ch.delta.content or "" for ch in mine) == whole.choices[i].message.content
        assert [ch.finish_reason for ch in mine if ch.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    parts = list(c.completions.create(model=MODEL, prompt="Rivers", n=2, seed=3, stream=True, **SAMPLED))
    assert {p.choices[0].index for p in parts} == {0, 1}


def test_best_of_returns_the_highest_cumulative_logprob(clients_server):
    c = client(clients_server)
    kw = _as_ids(model=MODEL, prompt="Once upon a time", seed=21, **SAMPLED)
    candidates = []
    for i in range(3):
        ch = c.completions.create(**{**kw, "seed": 21 + i}).choices[0]
        candidates.append((sum(ch.logprobs.token_logprobs), _sampled_ids(ch)))
    best = max(candidates)
    out = c.completions.create(**kw, n=1, best_of=3)
    assert [ch.index for ch in out.choices] == [0]
    assert _sampled_ids(out.choices[0]) == best[1]
    assert sum(out.choices[0].logprobs.token_logprobs) == pytest.approx(best[0])
    assert out.usage.completion_tokens == 8  # the choice returned, as vLLM counts
    two = c.completions.create(**kw, n=2, best_of=3)
    assert [_sampled_ids(ch) for ch in two.choices] == [ids for _, ids in sorted(candidates, reverse=True)[:2]]
    plain = c.completions.create(model=MODEL, prompt="Once upon a time", seed=21, best_of=3, **SAMPLED)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == out.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", best_of=3, stream=True, max_tokens=2)
    assert e.value.code == "unsupported_parameter" and e.value.param == "best_of"


def test_offline_n_and_best_of():
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=9, max_tokens=6, ignore_eos=True)
    with LLM(device="cpu", dtype="float32") as llm:
        [out] = llm.generate("Once upon a time", params)
        alone = [llm.generate("Once upon a time", SamplingParams(temperature=1.0, seed=9 + i, max_tokens=6,
                                                                 ignore_eos=True, logprobs=0))[0].outputs[0]
                 for i in range(4)]
    ranked = sorted(alone, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.index for o in out.outputs] == [0, 1]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ranked]
    assert [o.cumulative_logprob for o in out.outputs] == pytest.approx([o.cumulative_logprob for o in ranked])
    assert all(o.logprobs is None for o in out.outputs)


# ---- batched prompts ----


@pytest.mark.parametrize("prompts", [["The river", "A small house on the hill"], [[5, 17, 200, 3], [250, 1, 2]]],
                         ids=["text", "token_ids"])
def test_batched_prompts_index_choices_prompt_by_prompt(clients_server, prompts):
    c = client(clients_server)
    out = c.completions.create(model=MODEL, prompt=prompts, n=2, **GREEDY)
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
    singles = [c.completions.create(model=MODEL, prompt=p, **GREEDY) for p in prompts]
    assert [ch.text for ch in out.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert out.usage.completion_tokens == 4 * 4


def test_one_bad_prompt_refuses_the_batch_and_queues_nothing(clients_server):
    queued = metric(clients_server, "neuron_prompt_tokens_total")
    with pytest.raises(openai.BadRequestError) as e:
        client(clients_server).completions.create(model=MODEL, prompt=[[5, 6, 7], [10**6]], n=2, max_tokens=2)
    assert e.value.param == "prompt" and "token id 1000000 is outside the vocabulary" in e.value.message
    assert metric(clients_server, "neuron_prompt_tokens_total") == queued


# ---- /tokenize and /detokenize ----


def test_tokenize_and_detokenize_round_trip(clients_server, default_tokenizer):
    text = "Rivers carry water to the sea."
    r = httpx.post(f"{clients_server.url}/tokenize", json={"model": MODEL, "prompt": text})
    ids = default_tokenizer.encode(text)
    assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": MAX_MODEL_LEN}
    back = httpx.post(f"{clients_server.url}/detokenize", json={"model": MODEL, "tokens": ids})
    assert back.json() == {"prompt": text, "content": text}  # vLLM's name, and llama-server's
    messages = [{"role": "user", "content": text}]
    chat = httpx.post(f"{clients_server.url}/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert chat["tokens"] == default_tokenizer.encode(default_tokenizer.apply_chat_template(messages))
    prompt_tokens = client(clients_server).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat["count"] == prompt_tokens.usage.prompt_tokens
    bad = httpx.post(f"{clients_server.url}/detokenize", json={"model": MODEL, "tokens": [10**6]})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "tokens")


def test_a_chat_continues_its_final_message_as_vllm_does(clients_server, default_tokenizer):
    """vLLM's add_generation_prompt and continue_final_message on /v1/chat/completions and /tokenize:
    the prompt ends inside the last message; both at once is a 400 naming the field."""
    started = [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The river"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(f"{clients_server.url}/tokenize", json={"model": MODEL, "messages": started, **flags}).json()
    rendered = default_tokenizer.apply_chat_template(started, add_generation_prompt=False)
    assert ids["tokens"] == default_tokenizer.encode(rendered[: rendered.rindex("The river") + len("The river")])
    out = client(clients_server).chat.completions.create(model=MODEL, messages=started, max_tokens=1,
                                                         extra_body=flags)
    assert out.usage.prompt_tokens == ids["count"]
    bare = httpx.post(f"{clients_server.url}/tokenize",
                      json={"model": MODEL, "messages": started, "add_generation_prompt": False}).json()
    assert bare["tokens"] == default_tokenizer.encode(rendered) and bare["count"] > ids["count"]
    both = httpx.post(f"{clients_server.url}/v1/chat/completions",
                      json={"model": MODEL, "messages": started, "continue_final_message": True, "max_tokens": 1})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    empty = httpx.post(f"{clients_server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [*started[:1], {"role": "assistant", "content": ""}], "max_tokens": 1, **flags})
    assert empty.status_code == 400
    assert "continue_final_message needs a last message" in empty.json()["error"]["message"]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(clients_server, default_tokenizer):
    """vLLM's truncate_prompt_tokens on completions and chat: a prompt longer than the context runs
    on its last tokens, the same tokens as sending those alone; echo shows what the model read."""
    ids = [(7 * i + 11) % 500 + 10 for i in range(MAX_MODEL_LEN + 200)]
    c = client(clients_server)
    cut = c.completions.create(model=MODEL, prompt=ids, echo=True, **_as_ids(
        temperature=0.0, max_tokens=4, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 100}))
    alone = c.completions.create(model=MODEL, prompt=ids[-100:], **_as_ids(**GREEDY))
    assert _sampled_ids(cut.choices[0])[-4:] == _sampled_ids(alone.choices[0])
    assert cut.usage.prompt_tokens == 100 and cut.choices[0].text.startswith(default_tokenizer.decode(ids[-100:]))
    text = " ".join(["river"] * (MAX_MODEL_LEN * 2))
    words = c.completions.create(model=MODEL, prompt=text, max_tokens=1, extra_body={"truncate_prompt_tokens": 50})
    assert words.usage.prompt_tokens == 50
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": 64})
    assert chat.usage.prompt_tokens == 64
    for keep, says in ((0, "must be -1, an integer >= 1, or null"), (MAX_MODEL_LEN + 1, "greater than this model's")):
        r = httpx.post(f"{clients_server.url}/v1/completions",
                       json={"model": MODEL, "prompt": "hi", "truncate_prompt_tokens": keep})
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(clients_server, route):
    """vLLM's stream_options.continuous_usage_stats: each chunk of a choice carries its prompt's
    tokens and the choice's tokens so far, counting up to the final usage chunk's."""
    c = client(clients_server)
    options = {"include_usage": True, "continuous_usage_stats": True}
    if route == "completions":
        chunks = list(c.completions.create(model=MODEL, prompt="Rivers", max_tokens=6, stream=True, n=2,
                                           stream_options=options, temperature=1.0, seed=4, extra_body={
                                               "ignore_eos": True}))
    else:
        chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Rivers"}],
                                                max_tokens=6, stream=True, n=2, stream_options=options,
                                                temperature=1.0, seed=4, extra_body={"ignore_eos": True}))
    final = chunks[-1].usage
    assert not chunks[-1].choices and final.completion_tokens == 12
    for index in (0, 1):
        seen = [ch.usage for ch in chunks if ch.choices and ch.choices[0].index == index]
        assert seen and all(u is not None and u.prompt_tokens == final.prompt_tokens for u in seen)
        counts = [u.completion_tokens for u in seen]
        assert counts == sorted(counts) and counts[-1] == 6 and all(u.total_tokens == u.prompt_tokens +
                                                                    u.completion_tokens for u in seen)
    plain = list(c.completions.create(model=MODEL, prompt="Rivers", max_tokens=3, stream=True,
                                      stream_options={"include_usage": True}))
    assert all(ch.usage is None for ch in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_suffix_fills_in_the_middle_in_the_models_format(tmp_path, clients_server):
    """OpenAI's (and Ollama's) `suffix`: a model whose vocabulary has Qwen's fill-in-the-middle tokens
    is asked for the middle in that format, the same tokens as sending the format's prompt itself;
    a model without them refuses the suffix by name."""
    import shutil

    import ollama
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    from neuron.utils.default_checkpoint import default_model_dir

    coder = tmp_path / "coder"
    shutil.copytree(default_model_dir(), coder)
    backend = Backend.from_file(str(coder / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<|fim_prefix|>", "<|fim_suffix|>",
                                                                       "<|fim_middle|>")])
    backend.save(str(coder / "tokenizer.json"))
    prefix, suffix = "def add(a, b):\n", "\n    return c\n"
    fim = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    greedy = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    with LiveServer(real_engine(str(coder), 1, name="coder", max_model_len=256)) as server:
        server.wait_ready()
        middle = client(server).completions.create(model="coder", prompt=prefix, suffix=suffix, **greedy)
        direct = client(server).completions.create(model="coder", prompt=fim, **greedy)
        assert middle.choices[0].text == direct.choices[0].text
        assert middle.usage.prompt_tokens == direct.usage.prompt_tokens
        generated = ollama.Client(host=server.url).generate("coder", prefix, suffix=suffix,
                                                            options={"temperature": 0, "num_predict": 6})
        assert generated.response == direct.choices[0].text[: len(generated.response)]
    r = httpx.post(f"{clients_server.url}/v1/completions", json={"model": MODEL, "prompt": prefix, "suffix": suffix})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "no fill-in-the-middle tokens" in r.json()["error"]["message"]


def test_a_chat_returns_its_prompts_logprobs_as_vllm_does(clients_server):
    """vLLM's prompt_logprobs on /v1/chat/completions: the rendered prompt's tokens' logprobs, on the
    response, as /v1/completions gives them for the same tokens; priority other than 0 is refused."""
    messages = [{"role": "user", "content": "Rivers carry water."}]
    chat = client(clients_server).chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                          extra_body={"prompt_logprobs": 2})
    ids = httpx.post(f"{clients_server.url}/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    plain = httpx.post(f"{clients_server.url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1,
                                                                      "prompt_logprobs": 2}).json()
    got, want = chat.model_extra["prompt_logprobs"], plain["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) == chat.usage.prompt_tokens and got[0] is None
    assert all(str(t) in entry for t, entry in zip(ids[1:], got[1:]))
    for a, b in zip(got[1:], want[1:]):
        assert a.keys() == b.keys()
        assert [a[k]["logprob"] for k in a] == pytest.approx([b[k]["logprob"] for k in b], abs=1e-4)
    plain_chat = client(clients_server).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert plain_chat.model_extra.get("prompt_logprobs") is None
    for body, param in (({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"), ({"priority": 1}, "priority")):
        r = httpx.post(f"{clients_server.url}/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                          "max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_return_token_ids_gives_the_prompts_and_each_choices_tokens(clients_server, default_tokenizer):
    """vLLM's return_token_ids: the prompt's token ids and each choice's, on whole responses and on
    streams (the prompt's on a choice's first chunk, each chunk its own tokens), on both routes."""
    c = client(clients_server)
    greedy = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    text = "Rivers carry water"
    whole = c.completions.create(model=MODEL, prompt=text, **greedy).choices[0].model_extra
    assert whole["prompt_token_ids"] == default_tokenizer.encode(text, add_special_tokens=True)
    assert len(whole["token_ids"]) == 6
    chunks = [ch.choices[0].model_extra for ch in c.completions.create(model=MODEL, prompt=text, stream=True,
                                                                        **greedy) if ch.choices]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all(ch["prompt_token_ids"] is None for ch in chunks[1:])
    assert [t for ch in chunks for t in ch["token_ids"]] == whole["token_ids"]

    messages = [{"role": "user", "content": text}]
    chat = c.chat.completions.create(model=MODEL, messages=messages, **greedy)
    ids = httpx.post(f"{clients_server.url}/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    assert chat.model_extra["prompt_token_ids"] == ids and len(chat.choices[0].model_extra["token_ids"]) == 6
    streamed = list(c.chat.completions.create(model=MODEL, messages=messages, stream=True, **greedy))
    assert streamed[0].model_extra["prompt_token_ids"] == ids
    assert [t for ch in streamed for t in ch.choices[0].model_extra["token_ids"]] == \
        chat.choices[0].model_extra["token_ids"]
    plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert "prompt_token_ids" not in plain.model_extra and "token_ids" not in plain.choices[0].model_extra


def test_documents_reach_the_template_and_unimplemented_extensions_are_refused(tmp_path, clients_server):
    """vLLM's `documents` reach a chat template that renders them (chat_template_kwargs' win where both
    set them); vLLM's extensions neuron does not implement are refused by name, not ignored."""
    import shutil

    from neuron.engine.tokenizer import Tokenizer
    from neuron.utils.default_checkpoint import default_model_dir

    rag = tmp_path / "rag"
    shutil.copytree(default_model_dir(), rag)
    config = json.loads((rag / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for d in documents or [] %}DOC {{ d['text'] }}\n{% endfor %}"
                               "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    (rag / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(rag)
    messages = [{"role": "user", "content": "Which river?"}]
    docs = [{"text": "The Seine flows through Paris."}]
    with LiveServer(real_engine(str(rag), 1, name="rag", max_model_len=128)) as server:
        server.wait_ready()
        api = client(server)
        out = api.chat.completions.create(model="rag", messages=messages, max_tokens=1, extra_body={"documents": docs})
        want = "DOC The Seine flows through Paris.\nuser: Which river?\n"
        assert out.usage.prompt_tokens == len(tok.encode(want))
        both = api.chat.completions.create(model="rag", messages=messages, max_tokens=1, extra_body={
            "documents": docs, "chat_template_kwargs": {"documents": [{"text": "x"}]}})
        assert both.usage.prompt_tokens == len(tok.encode("DOC x\nuser: Which river?\n"))
    for name in ("structural_tag", "guided_whitespace_pattern", "logits_processors", "kv_transfer_params", "vllm_xargs"):
        r = httpx.post(f"{clients_server.url}/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": 1, name: {"x": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


def test_tokenize_needs_a_tokenizer(odd_checkpoint):
    with LiveServer(real_engine(str(odd_checkpoint), 1, name="odd")) as server:
        server.wait_ready()
        for path, body in (("tokenize", {"prompt": "hi"}), ("detokenize", {"tokens": [1, 2]})):
            r = httpx.post(f"{server.url}/{path}", json={"model": "odd", **body})
            assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]


# ---- response details ----


def test_chat_logprob_bytes_are_the_tokens_own(clients_server, default_tokenizer):
    c = client(clients_server)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write in French."}], logprobs=True,
              top_logprobs=20, temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
    ids = c.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "return_tokens_as_token_ids": True}})
    text = c.chat.completions.create(**kw)
    seen = []
    for by_id, by_text in zip(ids.choices[0].logprobs.content, text.choices[0].logprobs.content):
        for a, b in zip([by_id, *by_id.top_logprobs], [by_text, *by_text.top_logprobs]):
            own = list(default_tokenizer.token_bytes(int(a.token.removeprefix("token_id:"))))
            assert b.bytes == own
            seen.append(bytes(own))
    partial = [b for b in seen if not _is_utf8(b)]
    assert partial and all(list(b) != [239, 191, 189] for b in partial)  # part of a character, not U+FFFD


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_a_plain_assistant_message_has_no_tool_calls_key(clients_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    r = httpx.post(f"{clients_server.base_url}/chat/completions", json=body)
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]
    with httpx.stream("POST", f"{clients_server.base_url}/chat/completions", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events and all("tool_calls" not in ch["delta"] for e in events for ch in e["choices"])


# ---- the command line ----


def test_bench_against_a_closed_port_says_cannot_connect(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert run_command(["bench", "--base-url", f"http://127.0.0.1:{port}/v1", "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"neuron bench: cannot connect to http://127.0.0.1:{port}/v1") and "--model" not in err


def test_generate_with_an_unknown_model_prints_one_line():
    out = subprocess.run([sys.executable, "-m", "neuron", "generate", "/nonexistent"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "neuron generate: model path /nonexistent does not exist\n"
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_vllms_request_id_names_the_response_and_never_joins_two_requests(clients_server):
    """vLLM's `request_id`: the response's id is `chatcmpl-<id>` (`cmpl-<id>`, streamed too), and two
    requests that send the same one run side by side, each to its own end."""
    c = client(clients_server)
    messages = [{"role": "user", "content": "Rivers"}]
    chat = c.chat.completions.create(model=MODEL, messages=messages, **{**GREEDY, "extra_body": {
        "ignore_eos": True, "request_id": "trace-1"}})
    assert chat.id == "chatcmpl-trace-1"
    body = {"model": MODEL, "prompt": "Rivers", "max_tokens": 12, "ignore_eos": True, "request_id": "same"}

    def complete(_):
        return httpx.post(f"{clients_server.url}/v1/completions", json=body, timeout=60).json()

    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(complete, range(2)))
    assert [b["id"] for b in both] == ["cmpl-same"] * 2
    assert [b["usage"]["completion_tokens"] for b in both] == [12, 12]
    chunks = list(c.completions.create(model=MODEL, prompt="Rivers", stream=True, max_tokens=2,
                                       extra_body={"request_id": "streamed"}))
    assert {ch.id for ch in chunks} == {"cmpl-streamed"}
    for bad in ("", "a\nb", "x" * 300):
        r = httpx.post(f"{clients_server.url}/v1/chat/completions",
                       json={"model": MODEL, "messages": messages, "request_id": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", bad


def test_an_x_request_id_header_names_the_response_and_comes_back(clients_server):
    """vLLM's `X-Request-Id`: it names a chat or completion response before the body's
    `request_id`, and comes back on any response (a refusal too) for tracing; a value that is not
    visible ASCII of at most 256 characters is neither used nor echoed."""
    url, messages = clients_server.url, [{"role": "user", "content": "Rivers"}]
    r = httpx.post(f"{url}/v1/chat/completions", headers={"X-Request-Id": "proxy-7"},
                   json={"model": MODEL, "messages": messages, "max_tokens": 2, "request_id": "body"})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-proxy-7" and r.headers["x-request-id"] == "proxy-7"
    r = httpx.post(f"{url}/v1/completions", headers={"X-Request-Id": "c-1"},
                   json={"model": MODEL, "prompt": "Rivers", "max_tokens": 2, "stream": True})
    assert r.headers["x-request-id"] == "c-1" and '"id":"cmpl-c-1"' in r.text
    refused = httpx.post(f"{url}/v1/completions", headers={"X-Request-Id": "bad-1"}, json={"model": MODEL})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-1"
    assert httpx.get(f"{url}/health", headers={"X-Request-Id": "h"}).headers["x-request-id"] == "h"
    for odd in ("x" * 257, "has space", "caf\u00e9"):
        r = httpx.post(f"{url}/v1/completions", headers={"X-Request-Id": odd.encode("utf-8")},
                       json={"model": MODEL, "prompt": "Rivers", "max_tokens": 1})
        assert r.status_code == 200 and "x-request-id" not in r.headers and r.json()["id"].startswith("cmpl-")
        assert odd not in r.json()["id"]
    assert "x-request-id" not in httpx.get(f"{url}/health").headers
