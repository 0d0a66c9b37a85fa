"""llama-server's own API (/completion, /infill, /props, /apply-template, and /tokenize and
/detokenize in its shapes) on a real model whose vocabulary has Qwen's fill-in-the-middle and
repository tokens: the same tokens as the OpenAI completions route for the same request, streamed
and not, stop words and why an answer stopped, several prompts, n_predict 0, log-probabilities,
grammars and schemas, logit biases, and refusals in llama-server's error shape; a scripted engine
for a failure mid-stream."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import ERROR, LiveServer, ScriptedEngine, real_engine, scripted_engine
from test_fuzz_http import FUZZ, nasty, odd_text

from neuron.engine.tokenizer import Tokenizer

MODEL = "coder"
FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>")
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def coder_dir(tmp_path_factory):
    """The default checkpoint with Qwen's fill-in-the-middle and repository tokens added."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    from neuron.utils.default_checkpoint import default_model_dir

    coder = tmp_path_factory.mktemp("llamacpp") / "coder"
    shutil.copytree(default_model_dir(), coder)
    backend = Backend.from_file(str(coder / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True) for t in FIM])
    backend.save(str(coder / "tokenizer.json"))
    return coder


@pytest.fixture(scope="module")
def server(coder_dir):
    with LiveServer(real_engine(str(coder_dir), 1, name=MODEL, max_model_len=256)) as live:
        yield live.wait_ready()


@pytest.fixture(scope="module")
def tokenizer(coder_dir):
    return Tokenizer.from_dir(coder_dir)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def openai_completion(server, prompt, **kw) -> dict:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "return_token_ids": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def events(server, path: str, body: dict) -> list[dict]:
    """A streamed answer's events, checking each is an SSE `data:` line of JSON and none is [DONE]."""
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b and not b.startswith(":")]
    assert all(b.startswith("data: ") for b in blocks)
    return [json.loads(b[len("data: "):]) for b in blocks]


def test_a_completion_is_the_openai_routes_completion(server):
    prompt = "Rivers carry water to the"
    got = post(server, "/completion", {"prompt": prompt, "n_predict": 8, "return_tokens": True, **GREEDY}).json()
    want = openai_completion(server, prompt, max_tokens=8, **GREEDY)
    assert got["content"] == want["choices"][0]["text"] and got["tokens"] == want["choices"][0]["token_ids"]
    assert (got["tokens_predicted"], got["tokens_evaluated"]) == (8, want["usage"]["prompt_tokens"])
    assert (got["stop"], got["stop_type"], got["stopping_word"], got["prompt"]) == (True, "limit", "", prompt)
    assert got["model"] == MODEL and got["generation_settings"]["n_predict"] == 8
    assert got["generation_settings"]["n_ctx"] == 256 and got["timings"]["predicted_n"] == 8
    assert got["timings"]["prompt_n"] == got["tokens_evaluated"] and got["timings"]["predicted_ms"] >= 0
    # max_tokens is llama-server's other name for n_predict; without return_tokens, no tokens
    other = post(server, "/completion", {"prompt": prompt, "max_tokens": 8, **GREEDY}).json()
    assert other["content"] == got["content"] and other["tokens"] == []


def test_a_streamed_answer_is_the_whole_answer_in_pieces(server):
    body = {"prompt": "Rivers carry water to the", "n_predict": 10, "return_tokens": True, **GREEDY}
    whole = post(server, "/completion", body).json()
    streamed = events(server, "/completion", body)
    parts, last = streamed[:-1], streamed[-1]
    assert all(not p["stop"] and p["index"] == 0 for p in parts)
    assert "".join(p["content"] for p in parts) == whole["content"]
    assert [t for p in parts for t in p["tokens"]] == whole["tokens"]
    assert [p["tokens_predicted"] for p in parts] == sorted(p["tokens_predicted"] for p in parts)
    assert last["stop"] and last["content"] == "" and last["stop_type"] == "limit" and last["tokens_predicted"] == 10
    assert last["timings"]["predicted_n"] == 10 and last["generation_settings"]["stream"] is True


def test_a_stop_word_ends_the_answer_and_is_named(server):
    prompt = "Rivers carry water to the"
    free = post(server, "/completion", {"prompt": prompt, "n_predict": 12, **GREEDY})
    text = free.json()["content"]
    word = text[len(text) // 2:len(text) // 2 + 3]
    assert word.strip(), text  # a stop word the greedy answer reaches
    stopped = post(server, "/completion", {"prompt": prompt, "n_predict": 12, "stop": [word], **GREEDY}).json()
    assert (stopped["stop_type"], stopped["stopping_word"]) == ("word", word)
    assert stopped["content"] == text[:text.index(word)]
    streamed = events(server, "/completion", {"prompt": prompt, "n_predict": 12, "stop": [word], **GREEDY})
    assert streamed[-1]["stop_type"] == "word" and "".join(e["content"] for e in streamed) == stopped["content"]


def test_several_prompts_and_prompts_of_ids_and_text(server, tokenizer):
    """A list of texts is several prompts, answered in an array in order; a list holding ids is one
    prompt, its texts tokenized without special tokens beyond the first; n_cmpl samples each."""
    texts = ["Rivers carry", "Mountains rise"]
    both = post(server, "/completion", {"prompt": texts, "n_predict": 4, **GREEDY}).json()
    alone = [post(server, "/completion", {"prompt": t, "n_predict": 4, **GREEDY}).json()["content"] for t in texts]
    assert [a["index"] for a in both] == [0, 1] and [a["content"] for a in both] == alone
    head = tokenizer.encode("Rivers carry", add_special_tokens=True)
    mixed = post(server, "/completion", {"prompt": [*head, " water"], "n_predict": 4, **GREEDY}).json()
    ids = head + tokenizer.encode(" water", add_special_tokens=False)
    assert mixed["tokens_evaluated"] == len(ids)
    assert mixed["content"] == openai_completion(server, ids, max_tokens=4, **GREEDY)["choices"][0]["text"]
    sampled = post(server, "/completion", {"prompt": texts, "n_cmpl": 2, "n_predict": 3, **GREEDY}).json()
    assert [a["index"] for a in sampled] == [0, 1, 2, 3] and sampled[0]["content"] == sampled[1]["content"]
    streamed = events(server, "/completion", {"prompt": texts, "n_predict": 4, **GREEDY})
    for k, want in enumerate(alone):
        assert "".join(e["content"] for e in streamed if e["index"] == k) == want


def test_n_predict_zero_reads_the_prompt_and_writes_nothing(server):
    got = post(server, "/completion", {"prompt": "Rivers carry water", "n_predict": 0}).json()
    assert (got["content"], got["tokens_predicted"], got["stop_type"]) == ("", 0, "limit")
    assert got["tokens_evaluated"] > 0 and got["generation_settings"]["n_predict"] == 0
    streamed = events(server, "/completion", {"prompt": "Rivers carry water", "n_predict": 0})
    assert len(streamed) == 1 and streamed[0]["stop"] and streamed[0]["tokens_predicted"] == 0


def test_n_probs_are_the_openai_routes_logprobs(server, tokenizer):
    prompt = "Rivers carry water to the"
    got = post(server, "/completion", {"prompt": prompt, "n_predict": 5, "n_probs": 3, "return_tokens": True,
                                       **GREEDY}).json()
    want = openai_completion(server, prompt, max_tokens=5, logprobs=3, **GREEDY)["choices"][0]["logprobs"]
    probs = got["completion_probabilities"]
    assert [p["id"] for p in probs] == got["tokens"] and len(probs) == 5
    for p, logprob, top in zip(probs, want["token_logprobs"], want["top_logprobs"]):
        assert p["logprob"] == pytest.approx(logprob, abs=1e-5)
        assert len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"]  # greedy: the best
        assert [t["logprob"] for t in p["top_logprobs"]] == pytest.approx(sorted(top.values(), reverse=True)[:3],
                                                                          abs=1e-5)
        assert bytes(p["bytes"]) == tokenizer.token_bytes(p["id"])
    streamed = events(server, "/completion", {"prompt": prompt, "n_predict": 5, "n_probs": 3, **GREEDY})
    assert [p["id"] for e in streamed[:-1] for p in e["completion_probabilities"]] == got["tokens"]


def test_a_grammar_and_a_json_schema_shape_the_answer(server):
    yes_no = post(server, "/completion", {"prompt": "Is water wet?", "n_predict": 8, "temperature": 0,
                                          "grammar": 'root ::= "yes" | "no"'}).json()
    assert yes_no["content"] in ("yes", "no") and yes_no["stop_type"] == "eos"
    schema = {"type": "object", "properties": {"river": {"enum": ["Nile", "Rhine"]}}, "required": ["river"],
              "additionalProperties": False}
    shaped = post(server, "/completion", {"prompt": "A river:", "n_predict": 30, "temperature": 0,
                                          "json_schema": schema}).json()
    assert json.loads(shaped["content"])["river"] in ("Nile", "Rhine")
    bad = post(server, "/completion", {"prompt": "x", "grammar": "root ::= ("})
    assert bad.status_code == 400 and "grammar" in bad.json()["error"]["message"]


def test_logit_bias_in_each_of_its_forms(server, tokenizer):
    prompt = "Rivers carry water to the"
    first = post(server, "/completion", {"prompt": prompt, "n_predict": 1, "return_tokens": True,
                                         **GREEDY}).json()["tokens"][0]
    for bias in ([[first, False]], [[first, -100]], {str(first): -100},
                 [[tokenizer.decode([first], skip_special_tokens=False), False]]):
        other = post(server, "/completion", {"prompt": prompt, "n_predict": 1, "return_tokens": True,
                                             "logit_bias": bias, **GREEDY})
        assert other.status_code == 200 and other.json()["tokens"][0] != first, bias
    bad = post(server, "/completion", {"prompt": prompt, "logit_bias": [[first, "x"]]})
    assert bad.status_code == 400 and "logit_bias[0]" in bad.json()["error"]["message"]
    for odd in ({"\u00b2": 1.0}, {"9" * 5000: 1.0}, [["", 2.0]]):  # texts that look like numbers, or are empty
        assert post(server, "/completion", {"prompt": prompt, "n_predict": 1, "logit_bias": odd}).status_code == 200
    many = post(server, "/completion", {"prompt": prompt, "logit_bias": {f"w{i}": 1.0 for i in range(2000)}})
    assert many.status_code == 400 and "at most" in many.json()["error"]["message"]


@pytest.mark.parametrize(("body", "words"), [
    ({"mirostat": 2}, "mirostat (Mirostat sampling) is not supported"),
    ({"dry_multiplier": 0.8}, "DRY sampling"),
    ({"typical_p": 0.5}, "typical_p"),
    ({"repeat_penalty": 1.1, "repeat_last_n": -3}, "repeat_last_n must be"),
    ({"post_sampling_probs": True}, "post_sampling_probs"),
    ({"image_data": [{"data": "eA==", "id": 1}]}, "images are not supported"),
    ({"lora": [{"id": 0, "scale": 1.0}]}, "lora"),
    ({"n_predict": -3}, "n_predict must be"),
    ({"seed": -2}, "seed must be"),
    ({"prompt": {"prompt_string": "x", "multimodal_data": ["eA=="]}}, "multimodal_data"),
    ({"prompt": 7}, "prompt must be"),
    ({"prompt": []}, "prompt must be"),
    ({"prompt": [[1, 2], 3.5]}, "prompt[1] must be"),
    ({"input_prefix": "a"}, "belong to /infill"),
    ({"n_cmpl": 0}, "n_cmpl"),
    ({"temperature": -1}, "temperature"),
    ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "only one of"),
])
def test_what_cannot_be_honoured_is_refused_in_llama_servers_shape(server, body, words):
    r = post(server, "/completion", {"prompt": "Rivers", "n_predict": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error" and words in error["message"], error


def test_a_penalty_over_a_window_the_whole_context_or_none(server):
    prompt = "Rivers carry water to the"
    plain = post(server, "/completion", {"prompt": prompt, "n_predict": 12, **GREEDY}).json()["content"]
    off = post(server, "/completion", {"prompt": prompt, "n_predict": 12, "repeat_penalty": 1.5,
                                       "repeat_last_n": 0, **GREEDY}).json()["content"]
    whole = post(server, "/completion", {"prompt": prompt, "n_predict": 12, "repeat_penalty": 1.5,
                                         "repeat_last_n": -1, **GREEDY})
    want = openai_completion(server, prompt, max_tokens=12, repetition_penalty=1.5, **GREEDY)["choices"][0]["text"]
    assert off == plain and whole.json()["content"] == want
    for last_n, window in ((None, 64), (3, 3)):  # llama-server's window: 64 unless given
        body = {"prompt": prompt, "n_predict": 12, "repeat_penalty": 1.5, **GREEDY}
        got = post(server, "/completion", body if last_n is None else {**body, "repeat_last_n": last_n}).json()
        want = openai_completion(server, prompt, max_tokens=12, repetition_penalty=1.5, repetition_window=window,
                                 **GREEDY)["choices"][0]["text"]
        assert got["content"] == want and got["generation_settings"]["repeat_last_n"] == window


def test_infill_asks_for_the_middle_after_the_files(server, tokenizer):
    prefix, suffix = "def add(a, b):\n", "\n    return c\n"
    fim = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    got = post(server, "/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 6, **GREEDY}).json()
    assert got["content"] == openai_completion(server, fim, max_tokens=6, **GREEDY)["choices"][0]["text"]
    extra = [{"filename": "util.py", "text": "X = 1\n"}]
    files = "<|repo_name|>myproject\n<|file_sep|>util.py\nX = 1\n<|file_sep|>filename\n"
    with_files = post(server, "/infill", {"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra,
                                          "prompt": "    c", "n_predict": 6, **GREEDY}).json()
    assert with_files["prompt"] == files + fim + "    c"
    want = openai_completion(server, files + fim + "    c", max_tokens=6, **GREEDY)["choices"][0]
    assert with_files["content"] == want["text"]
    bad = post(server, "/infill", {"input_prefix": prefix, "input_extra": [{"text": 3}]})
    assert bad.status_code == 400 and "input_extra" in bad.json()["error"]["message"]


def test_props_and_apply_template_describe_the_model(server, tokenizer, coder_dir):
    props = httpx.get(f"{server.url}/props").json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 256 and settings["params"]["n_predict"] == -1
    assert props["chat_template"] == tokenizer.chat_template and props["model_path"] == str(coder_dir)
    assert props["model_alias"] == MODEL and props["total_slots"] > 0 and props["build_info"].startswith("neuron")
    messages = [{"role": "user", "content": "hello"}]
    rendered = post(server, "/apply-template", {"messages": messages}).json()["prompt"]
    assert rendered == tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert post(server, "/apply-template", {"messages": []}).status_code == 400


def test_tokenize_and_detokenize_in_llama_servers_shapes(server, tokenizer):
    text = "Rivers carry <|fim_prefix|> water"
    ids = post(server, "/tokenize", {"content": text}).json()["tokens"]
    assert ids == tokenizer.encode(text, add_special_tokens=False) and tokenizer.token_to_id("<|fim_prefix|>") in ids
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == text
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": text, "content": text}
    vllm = post(server, "/tokenize", {"prompt": text, "model": MODEL}).json()  # vLLM's shape beside it
    assert vllm["tokens"] == ids and vllm["count"] == len(ids)
    r = post(server, "/tokenize", {"content": text, "parse_special": False})
    assert r.status_code == 400 and "parse_special" in r.json()["error"]["message"]


def test_a_failure_mid_stream_is_an_error_event(default_tokenizer):
    stub = ScriptedEngine(default_tokenizer, {"explode": ["Hello", ERROR]})
    with LiveServer(scripted_engine(stub)) as live:
        live.wait_ready(10)
        with httpx.stream("POST", f"{live.url}/completion", json={"prompt": "explode", "stream": True}) as r:
            body = r.read().decode()
        blocks = [json.loads(b[len("data: "):]) for b in body.split("\n\n") if b.startswith("data: ")]
        assert blocks[0]["content"] == "Hello" and blocks[-1]["error"]["code"] == 503
        r = httpx.post(f"{live.url}/completion", json={"prompt": "explode"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"


def test_prompts_past_what_one_request_may_hold_or_outside_the_vocabulary(server):
    many = post(server, "/completion", {"prompt": ["x"] * 1000, "n_predict": 1})
    assert many.status_code == 400 and "1000 prompts" in many.json()["error"]["message"]
    for ids in ([-1, 5], [10**9]):
        r = post(server, "/completion", {"prompt": ids, "n_predict": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text
    long = post(server, "/completion", {"prompt": "water " * 400, "n_predict": 1})
    assert long.status_code == 400 and "context" in long.json()["error"]["message"]


FIELDS = ["prompt", "n_predict", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "ignore_eos",
          "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "logit_bias", "n_probs", "n_cmpl",
          "stream", "return_tokens", "grammar", "json_schema", "response_fields", "input_prefix", "input_suffix",
          "input_extra", "typical_p", "mirostat", "model", "cache_salt", "post_sampling_probs"]


@st.composite
def llamacpp_bodies(draw) -> dict:
    """A valid request (a prompt of text, ids or both, a few tokens), then up to three of its fields
    set to anything or dropped."""
    body = {"prompt": draw(st.sampled_from(["Rivers carry", [1, 2, 3], [5, "water"], ["a", "b"]])),
            "n_predict": 2, "stream": draw(st.booleans())}
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.integers(0, 4)) == 0:
            body.pop(draw(st.sampled_from(sorted(body))), None)
        else:
            body[draw(st.sampled_from(FIELDS))] = draw(nasty | odd_text)
    return body


@settings(FUZZ, max_examples=60, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=llamacpp_bodies(), infill=st.booleans())
def test_generated_bodies_are_answered_or_refused_in_llama_servers_shape(server, body, infill):
    """Whatever a client sends: never a 500, every refusal llama-server's error, every stream ended
    by its last object."""
    if "n_predict" in body and isinstance(body["n_predict"], int) and not isinstance(body["n_predict"], bool):
        body["n_predict"] = min(body["n_predict"], 4)  # a few tokens: a fuzz case, not a long generation
    r = httpx.post(f"{server.url}{'/infill' if infill else '/completion'}", content=json.dumps(body).encode(),
                   timeout=60, headers={"content-type": "application/json"})
    context = f"body {body!r:.600}\nanswer {r.status_code} {r.text[:600]}"
    assert r.status_code in (200, 400, 404, 413), context
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"code", "message", "type"} and error["code"] == r.status_code, context
    elif r.headers["content-type"].startswith("text/event-stream"):
        objects = [json.loads(b[len("data: "):]) for b in r.text.split("\n\n") if b.startswith("data: ")]
        assert objects and (objects[-1].get("stop") is True or "error" in objects[-1]), context
    else:
        answers = r.json() if isinstance(r.json(), list) else [r.json()]
        assert all(a.get("stop", True) for a in answers), context
