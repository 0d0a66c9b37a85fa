"""`neuron serve` end to end with real engines at tp 1 and 2, through the official openai client.

One server per (checkpoint, tp) for the whole module: the default model for the API surface,
the odd checkpoint (no tokenizer) for numerical parity with transformers through the HTTP API.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest
from checkpoints import reference_greedy
from server_harness import LiveServer, async_client, client, metric, real_engine, token_ids, wait_until

MAX_MODEL_LEN = 1024
PARITY_PROMPTS = [[5, 17, 200, 3], list(range(10, 50)), [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)], ids=lambda tp: f"tp{tp}")
def default_server(request):
    with LiveServer(real_engine(None, request.param, max_model_len=MAX_MODEL_LEN)) as server:
        yield server.wait_ready()


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)], ids=lambda tp: f"tp{tp}")
def odd_server(request, odd_checkpoint):
    with LiveServer(real_engine(str(odd_checkpoint), request.param, name="odd")) as server:
        yield server.wait_ready()


# ---- the API surface on the default model ----


def test_health_and_models(default_server):
    health = httpx.get(f"{default_server.url}/health").json()
    ranks = health.pop("memory")  # each rank's weight, KV cache and resident bytes
    assert health == {"status": "ready", "kernels": {"paged_attention": "cpu"}}
    assert len(ranks) == len(client(default_server).models.list().data[0].model_extra["devices"])
    for rank in ranks:
        assert set(rank) == {"weight_bytes", "kv_bytes", "resident_bytes"}
        assert 0 < rank["weight_bytes"] < rank["resident_bytes"] and rank["kv_bytes"] > 0
    models = client(default_server).models.list()
    assert [m.id for m in models.data] == ["neuron-default"]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_chat_completion(default_server):
    out = client(default_server).chat.completions.create(
        model="neuron-default", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == "neuron-default"
    choice = out.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_logit_bias_and_allowed_token_ids(default_server):
    """OpenAI's logit_bias (its keys token ids as strings, a bias past 100 clamped to it, as vLLM
    does) and vLLM's allowed_token_ids steer what is sampled; a token outside the vocabulary is a 400."""
    body = {"model": "neuron-default", "prompt": [5, 17, 200], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True}
    plain = httpx.post(f"{default_server.base_url}/completions", json=body).json()["choices"][0]
    first = int(plain["logprobs"]["tokens"][0].removeprefix("token_id:"))
    forced = httpx.post(f"{default_server.base_url}/completions",
                        json={**body, "logit_bias": {"42": 500, str(first): -100}}).json()["choices"][0]
    assert forced["logprobs"]["tokens"] == ["token_id:42"] * 4
    assert forced["logprobs"]["token_logprobs"][0] < plain["logprobs"]["token_logprobs"][0]  # the raw logprob
    allowed = httpx.post(f"{default_server.base_url}/chat/completions", json={
        "model": "neuron-default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
        "temperature": 1.0, "seed": 3, "ignore_eos": True, "allowed_token_ids": [7, 9],
        "logprobs": True, "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert {t["token"] for t in allowed["logprobs"]["content"]} <= {"token_id:7", "token_id:9"}
    for extra, param in (({"logit_bias": {"1000000": 1}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                         ({"allowed_token_ids": [-1]}, "allowed_token_ids"), ({"allowed_token_ids": []},
                                                                               "allowed_token_ids"),
                         ({"bad_words": [" "]}, "bad_words")):
        r = httpx.post(f"{default_server.base_url}/completions", json={**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_completion_text_prompt(default_server, default_tokenizer):
    out = client(default_server).completions.create(model="neuron-default", prompt="The morning train",
                                                    max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens == len(default_tokenizer.encode("The morning train"))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"])
def test_stream_equals_non_stream(default_server, sampling):
    c = client(default_server)
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    kw = dict(model="neuron-default", max_tokens=24, extra_body={"ignore_eos": True}, **sampling)
    whole = c.chat.completions.create(messages=messages, **kw)
    chunks = list(c.chat.completions.create(messages=messages, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24

    whole = c.completions.create(prompt="Rivers carry water", **kw)
    parts = list(c.completions.create(prompt="Rivers carry water", stream=True, **kw))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text


def test_chat_logprobs(default_server):
    out = client(default_server).chat.completions.create(
        model="neuron-default", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the best
        assert bytes(entry.bytes).decode() == entry.token
    assert "".join(e.token for e in content) == out.choices[0].message.content


def test_stop_strings_and_token_ids(default_server):
    c = client(default_server)
    kw = dict(model="neuron-default", prompt="The", max_tokens=12, temperature=1.0, seed=3,
              extra_body={"ignore_eos": True})
    full = c.completions.create(**kw).choices[0].text
    at = next(k for k in range(3, len(full) - 1) if full.index(full[k: k + 2]) == k)  # a first occurrence
    cut = c.completions.create(stop=["zzzz", full[at: at + 2]], **kw).choices[0]
    assert cut.text == full[:at] and cut.finish_reason == "stop" and cut.stop_reason == full[at: at + 2]
    ids = c.completions.create(logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                               **{k: v for k, v in kw.items() if k != "extra_body"})
    tokens = token_ids(ids.choices[0].logprobs)
    stopped = c.completions.create(model="neuron-default", prompt="The", max_tokens=12, temperature=1.0, seed=3,
                                   extra_body={"ignore_eos": True, "stop_token_ids": [tokens[2]]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].stop_reason == tokens[2]
    assert stopped.usage.completion_tokens == tokens.index(tokens[2]) + 1  # the same seed draws the same tokens


def test_chat_turns_with_tools(default_server):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
        {"role": "assistant", "content": "It is 18 degrees."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    out = client(default_server).chat.completions.create(model="neuron-default", messages=messages, tools=tools,
                                                         max_tokens=4, temperature=0, extra_body=no_thinking)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    assert out.usage.prompt_tokens > 100  # the tool signatures and every turn are in the prompt


async def test_concurrent_requests_equal_alone(default_server):
    prompts = ["The morning train", "To make bread", "Rivers carry water", "The library opens",
               "Questions and answers", "In the autumn", "def add(a, b):", "She opened the door"]

    def kw(i):
        return dict(model="neuron-default", prompt=prompts[i], max_tokens=10, temperature=0.9, seed=100 + i,
                    logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})

    c = async_client(default_server)
    alone = [token_ids((await c.completions.create(**kw(i))).choices[0].logprobs) for i in range(8)]
    together = await asyncio.gather(*(c.completions.create(**kw(i)) for i in range(8)))
    assert [token_ids(out.choices[0].logprobs) for out in together] == alone


async def test_dropped_streams_leave_the_engine_clean(default_server):
    body = {"model": "neuron-default", "prompt": "Once", "max_tokens": 240, "temperature": 1.0, "stream": True,
            "ignore_eos": True}
    before_tokens = metric(default_server, "neuron_generation_tokens_total")
    before_aborts = metric(default_server, 'neuron_request_finished_total{reason="abort"}')

    async def drop_after_first_event():
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{default_server.base_url}/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        return

    await asyncio.gather(*(drop_after_first_event() for _ in range(30)))
    held = ("neuron_num_requests_running", "neuron_num_requests_waiting")
    wait_until(lambda: not any(metric(default_server, name) for name in held), 20,
               "aborted requests still hold the engine")
    assert metric(default_server, 'neuron_request_finished_total{reason="abort"}') - before_aborts == 30
    generated = metric(default_server, "neuron_generation_tokens_total") - before_tokens
    assert generated < 30 * 240 / 2, "aborted requests ran on instead of leaving at a step boundary"

    started = time.monotonic()
    out = client(default_server).completions.create(model="neuron-default", prompt="Once", max_tokens=8,
                                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8 and time.monotonic() - started < 5


# ---- errors ----


def test_unknown_model_is_404(default_server):
    with pytest.raises(openai.NotFoundError) as e:
        client(default_server).chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"


@pytest.mark.parametrize("payload,param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
    (b'{"model": "neuron-default"}', "messages"),
    (b'{"model": "neuron-default", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}',
     "max_tokens"),
    (b'{"model": "neuron-default", "messages": [{"role": "user", "content": "x"}], "temperature": -1}',
     "temperature"),
    (b'{"model": "neuron-default", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
     "max_completion_tokens"),
    (b'{"model": "neuron-default", "messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
    (b'{"model": "neuron-default", "messages": [{"role": "user", "content": "x"}], "n": 2, "best_of": 1}',
     "best_of"),
    (b'{"model": "neuron-default", "messages": [], "stream": true}', "messages"),
    (b'{"model": "neuron-default", "messages": [{"role": "user", "content": "x"}], "logprobs": true, '
     b'"top_logprobs": 50}', "top_logprobs"),
    (b'{"model": "neuron-default", "messages": [{"role": "bot", "content": "x"}]}', "messages[0].role"),
    (b'{"model": "neuron-default", "messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1e-300}',
     "repetition_penalty"),
    (b'{"model": "neuron-default", "messages": [{"role": "user", "content": "x"}], '
     b'"chat_template_kwargs": {"add_generation_prompt": false}}', "chat_template_kwargs"),
    (b'{"model": "neuron-default", "messages": [{"role": "user", "content": "x"}], "stop": [""]}', "stop"),
    (b'{"model": "neuron-default", "messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    (b'{"model": "neuron-default", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}',
     "tool_choice"),
])
def test_bad_chat_requests_are_400(default_server, payload, param):
    r = httpx.post(f"{default_server.base_url}/chat/completions", content=payload,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


@pytest.mark.parametrize("prompt", [[], [[1], []], ["a", 5], [1.5], {"x": 1}, [-1], [10**6], ["a", [10**6]]])
def test_bad_completion_prompts_are_400(default_server, prompt):
    r = httpx.post(f"{default_server.base_url}/completions", json={"model": "neuron-default", "prompt": prompt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"


def test_context_length_exceeded(default_server):
    c = client(default_server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="neuron-default", prompt=list(range(MAX_MODEL_LEN + 10)), max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="neuron-default", stream=True,
                                  messages=[{"role": "user", "content": "The morning train " * 400}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


def test_images_are_refused(default_server):
    with pytest.raises(openai.BadRequestError) as e:
        client(default_server).chat.completions.create(model="neuron-default", messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert e.value.code == "vision_unsupported"


def test_unknown_route_uses_the_envelope(default_server):
    r = httpx.get(f"{default_server.base_url}/engines")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_metrics_exposed(default_server):
    client(default_server).completions.create(model="neuron-default", prompt="a", max_tokens=2)
    text = httpx.get(f"{default_server.url}/metrics").text
    for name in ("neuron_requests_total", "neuron_prompt_tokens_total", "neuron_generation_tokens_total",
                 "neuron_time_to_first_token_seconds_bucket", "neuron_inter_token_latency_seconds_bucket",
                 "neuron_e2e_request_latency_seconds_bucket", "neuron_num_requests_running",
                 "neuron_num_requests_waiting", "neuron_kv_slot_usage_ratio", "neuron_engine_state"):
        assert name in text
    assert 'neuron_requests_total{endpoint="completions",status="200"}' in text
    assert 'neuron_requests_total{endpoint="chat",status="400"}' in text


# ---- numerical parity with transformers, through HTTP, on a checkpoint without a tokenizer ----


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_greedy_parity_with_transformers(odd_server, odd_checkpoint, stream):
    c = client(odd_server)
    for prompt in PARITY_PROMPTS:
        kw = dict(model="odd", prompt=prompt, max_tokens=8, temperature=0, logprobs=5,
                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        if stream:
            parts = [p.choices[0] for p in c.completions.create(stream=True, **kw) if p.choices]
            tokens = [t for p in parts if p.logprobs for t in token_ids(p.logprobs)]
            tops = [top for p in parts if p.logprobs for top in p.logprobs.top_logprobs]
            lps = [lp for p in parts if p.logprobs for lp in p.logprobs.token_logprobs]
        else:
            out = c.completions.create(**kw).choices[0]
            assert out.finish_reason == "length"
            tokens, tops, lps = token_ids(out.logprobs), out.logprobs.top_logprobs, out.logprobs.token_logprobs
        ref_tokens, ref_logprobs = reference_greedy(odd_checkpoint, prompt, 8)
        assert tokens == ref_tokens
        for step, (token, lp, top) in enumerate(zip(tokens, lps, tops)):
            assert abs(lp - ref_logprobs[step][token].item()) <= 1e-3
            assert {f"token_id:{t}" for t in ref_logprobs[step].topk(5).indices.tolist()} <= set(top)
            for name, value in top.items():
                assert abs(value - ref_logprobs[step][int(name.removeprefix("token_id:"))].item()) <= 1e-3


def test_text_needs_a_tokenizer(odd_server):
    with pytest.raises(openai.BadRequestError) as e:
        client(odd_server).completions.create(model="odd", prompt="hello")
    assert e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError):
        client(odd_server).chat.completions.create(model="odd", messages=[{"role": "user", "content": "hi"}])


def test_random_bad_input_never_500(default_server):
    """Fields of every kind of wrong type and range: the answer is never an internal error."""
    rng = random.Random(0)
    values = [None, -1, 0, 1, 1.5, -0.5, 1e-300, 1e300, "x", "", [], [""], [1], [-1], {}, {"a": 1}, True, 2**70,
              [[1], [2]], [{"type": "text", "text": "hi"}], [{"type": "image_url"}], [{"type": "text"}]]
    fields = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
              "stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
              "ignore_eos", "n", "logit_bias", "stream", "stream_options", "return_tokens_as_token_ids", "logprobs",
              "top_logprobs", "tools", "tool_choice", "chat_template_kwargs", "response_format", "echo", "suffix"]
    with httpx.Client(timeout=60) as http:
        for _ in range(150):
            chat = rng.random() < 0.5
            body = {"model": "neuron-default"}
            if chat:
                message = {"role": rng.choice(["user", "tool", None, 3]), "content": rng.choice(values)}
                body["messages"] = rng.choice([rng.choice(values), [message]])
            else:
                body["prompt"] = rng.choice(["hello", [1, 2, 3], *values])
            for _ in range(rng.randint(0, 4)):
                body[rng.choice(fields)] = rng.choice(values)
            for name in ("max_tokens", "max_completion_tokens"):  # keep the valid ones short
                if isinstance(body.get(name), int) and not isinstance(body[name], bool) and body[name] > 4:
                    body[name] = 4
            body.setdefault("max_tokens", 4)
            r = http.post(f"{default_server.base_url}/{'chat/completions' if chat else 'completions'}", json=body)
            assert r.status_code < 500, (body, r.text)
    assert httpx.get(f"{default_server.url}/health").status_code == 200
