"""Hostile clients against a live `neuron serve --tp 2`: each request that once crashed, starved or
exhausted the server is replayed while a normal stream runs. Each test asserts the answer (status
and error code, or the output when it is served), that the server is still up, that the normal
stream's tokens kept coming (no gap of 1 s or more), that /health answered every poll within 1 s,
and that the leader's RSS came back to within 100 MB of where it was before."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from server_harness import ServeProcess

from neuron import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 4096
MAX_NUM_SEQS = 16
PER_CLIENT = 8
SERVE_ARGS = ("--tp", "2", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
              "--max-waiting", "32", "--max-connections", "64", "--max-connections-per-client", str(PER_CLIENT),
              "--body-timeout-s", "3")
MODEL = "neuron-default"
GAP_S = HEALTH_S = 1.0
RSS_SLACK = 100 * 2**20


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory):
    with ServeProcess(*SERVE_ARGS) as server:
        yield server


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


class Watch:
    """A normal client beside a hostile one: a streaming completion restarted whenever it ends,
    whose gaps between tokens are kept, /health polled every 0.1 s with its answer times, and the
    leader's RSS before and after."""

    def __init__(self, server):
        self.server = server
        self.gaps: list[float] = []
        self.health: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._stream, daemon=True),
                         threading.Thread(target=self._poll, daemon=True)]
        self._tokens = threading.Event()

    def __enter__(self) -> Watch:
        self.rss_before = rss(self.server.pid)
        for t in self._threads:
            t.start()
        assert self._tokens.wait(30), "the normal stream did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _stream(self) -> None:
        body = {"model": getattr(self.server, "model", MODEL), "prompt": [5, 6, 7, 8], "max_tokens": 1000, "stream": True,
                "ignore_eos": True, "temperature": 0}
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                with http.stream("POST", f"{self.server.base_url}/completions", json=body) as r:
                    last = time.monotonic()
                    for line in r.iter_lines():
                        if self._stop.is_set():
                            return
                        if line.startswith("data: {"):
                            now = time.monotonic()
                            self.gaps.append(now - last)
                            last = now
                            self._tokens.set()

    def _poll(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.is_set():
                t0 = time.monotonic()
                status = http.get(f"{self.server.url}/health").status_code
                self.health.append((status, time.monotonic() - t0))
                time.sleep(0.1)

    def check(self) -> None:
        """The server stayed up and kept its pace; its memory came back."""
        assert self.server.proc.poll() is None, "the server died"
        assert max(self.gaps) < GAP_S, f"a normal stream waited {max(self.gaps):.2f} s for a token"
        assert all(status == 200 for status, _ in self.health), f"/health: {sorted(set(self.health))[:5]}"
        assert max(s for _, s in self.health) < HEALTH_S, f"/health took {max(s for _, s in self.health):.2f} s"
        deadline = time.monotonic() + 15
        while rss(self.server.pid) > self.rss_before + RSS_SLACK and time.monotonic() < deadline:
            time.sleep(0.5)
        grew = rss(self.server.pid) - self.rss_before
        assert grew <= RSS_SLACK, f"the leader kept {grew / 2**20:.0f} MiB more than before"


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}/{path}", json=body, timeout=120, **kw)


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kw}


def assert_refused(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- 1 and 10: grammars that recurse ----


def lark_chain(rules: int) -> str:
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(rules)), f'r{rules}: "x"'])


def defs_chain(links: int) -> dict:
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}]} for i in range(links)}
    defs[f"d{links}"] = {"type": "string", "enum": ["ok"]}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def test_a_chain_of_3000_lark_rules_compiles_and_is_served(hostile_server):
    with Watch(hostile_server) as watch:
        r = post(hostile_server, "chat/completions", chat(guided_grammar=lark_chain(3000)))
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["message"]["content"] == "x"
    watch.check()


@pytest.mark.parametrize("field", ["guided_json", "response_format", "tools"])
def test_a_chain_of_1100_defs_compiles_and_is_served(hostile_server, field):
    schema = defs_chain(1100)
    body = {"guided_json": {"guided_json": schema},
            "response_format": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                      "tool_choice": "required"}}[field]
    with Watch(hostile_server) as watch:
        r = post(hostile_server, "chat/completions", chat(max_tokens=60, **body))
    if field == "tools":  # compiled first; then the template writes the 50 KB schema into the prompt
        assert_refused(r, 400, "context_length_exceeded")
    else:
        assert r.status_code == 200, r.text[:300]
        assert json.loads(r.json()["choices"][0]["message"]["content"]) == "ok"
    watch.check()


def test_json_nested_past_the_limit_is_a_400(hostile_server):
    def nested(levels: int) -> str:
        return '{"type": "array", "items": ' * levels + '{"type": "string"}' + "}" * levels

    as_string = json.dumps(chat(guided_json=nested(1000)))
    as_object = json.dumps(chat(guided_json=None)).replace('"guided_json": null', f'"guided_json": {nested(960)}')
    with Watch(hostile_server) as watch:
        for body in (as_string, as_object):
            r = httpx.post(f"{hostile_server.base_url}/chat/completions", content=body,
                           headers={"content-type": "application/json"})
            error = assert_refused(r, 400, param="guided_json")
            assert "nested at most 128 levels" in error["message"]
    watch.check()


# ---- 2 and 12: requests a browser page or a proxy could be tricked into ----


def test_a_body_not_declared_json_is_a_415(hostile_server):
    body = json.dumps(chat())
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"content-type": kind} if kind else {}
        r = httpx.post(f"{hostile_server.base_url}/chat/completions", content=body, headers=headers)
        assert_refused(r, 415, "unsupported_media_type")


def test_a_browser_origin_is_refused_unless_allowed(hostile_server):
    r = post(hostile_server, "chat/completions", chat(), headers={"origin": "http://evil.example"})
    assert_refused(r, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in r.headers


def test_content_length_with_transfer_encoding_is_a_400_that_closes():
    with ServeProcess("--max-model-len", "256") as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            body = json.dumps(chat()).encode()
            chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
                         + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
    assert data.startswith(b"HTTP/1.1 400"), data[:200]
    assert b"ambiguous_framing" in data
    assert data.count(b"HTTP/1.1") == 1  # closed: what followed was never served


# ---- 4: grammars that are expensive to compile ----


def test_large_grammars_are_not_kept_and_do_not_hold_up_tokenizing(hostile_server):
    """The regex compiles (0.4 s, about 88 MB) and then runs out of llguidance's lexer budget on its
    first tokens: a 400 for its request alone, none of it kept."""
    with Watch(hostile_server) as watch:
        results = []

        def compile_heavy():
            for i in range(4):
                regex = f"((a{{1000}}){{1000}}){{1000}}x{time.monotonic_ns()}{i}"
                results.append(post(hostile_server, "chat/completions", chat(guided_regex=regex, max_tokens=2)))

        heavy = threading.Thread(target=compile_heavy)
        heavy.start()
        ttfts = []
        while heavy.is_alive():
            t0 = time.monotonic()
            r = post(hostile_server, "chat/completions", chat(max_tokens=1))
            assert r.status_code == 200
            ttfts.append(time.monotonic() - t0)
        heavy.join()
    assert [r.status_code for r in results] == [400] * 4
    assert all("structured output failed" in r.json()["error"]["message"] for r in results)
    assert max(ttfts) < 1.0, ttfts
    watch.check()


# ---- 5, 8 and 11: one request asking for everything ----


def test_n_is_capped_at_the_running_slots(hostile_server):
    with Watch(hostile_server) as watch:
        for n in (MAX_NUM_SEQS + 1, 272):
            r = post(hostile_server, "completions", {"model": MODEL, "prompt": "x", "n": n, "max_tokens": 4000})
            assert_refused(r, 400, param="n")
        r = post(hostile_server, "completions", {"model": MODEL, "prompt": "x", "n": 4, "max_tokens": 2})
        assert len(r.json()["choices"]) == 4
    watch.check()


def test_batched_prompts_past_the_cap_are_refused_before_tokenizing(hostile_server):
    prompts = ["a"] * 100_000
    with Watch(hostile_server) as watch:
        t0 = time.monotonic()
        r = post(hostile_server, "completions", {"model": MODEL, "prompt": prompts, "max_tokens": 1})
        assert_refused(r, 400, param="prompt")
        assert time.monotonic() - t0 < 5
    watch.check()


def test_prompt_logprobs_over_budget_are_refused_and_within_it_served(hostile_server):
    prompt = [10 + i % 1000 for i in range(MAX_MODEL_LEN - 1)]
    asks = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 20, "prompt_logprobs": 20, "max_tokens": 0}
    with Watch(hostile_server) as watch:
        assert_refused(post(hostile_server, "completions", {**asks, "n": 96}), 400, param="n")
        error = assert_refused(post(hostile_server, "completions", {**asks, "n": MAX_NUM_SEQS}), 400,
                               param="prompt_logprobs")
        assert "NEURON_MAX_PROMPT_LOGPROBS" in error["message"]
        r = post(hostile_server, "completions", {**asks, "logprobs": 5, "prompt_logprobs": None})
        assert r.status_code == 200
        assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == len(prompt)
    watch.check()


# ---- 6: stop lists ----


def test_huge_stop_lists_are_a_400(hostile_server):
    with Watch(hostile_server) as watch:
        error = assert_refused(post(hostile_server, "completions", {"model": MODEL, "prompt": "x",
                                                                    "stop": [f"s{i}" for i in range(400_000)]}),
                               400, param="stop")
        assert "at most 64" in error["message"]
        assert_refused(post(hostile_server, "completions", {"model": MODEL, "prompt": "x",
                                                            "stop_token_ids": [7] * 1_000_000}),
                       400, param="stop_token_ids")
    watch.check()


# ---- 7: bodies that trickle ----


def test_trickling_bodies_are_cut_and_capped_per_client(hostile_server):
    host, port = hostile_server.url.removeprefix("http://").split(":")
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\n\r\n")
    with Watch(hostile_server) as watch:
        socks = []
        for _ in range(18):  # from another loopback address: a client of its own
            sock = socket.create_connection((host, int(port)), timeout=10, source_address=("127.0.0.2", 0))
            sock.sendall(head)
            socks.append(sock)
        t0, answers = time.monotonic(), {}
        while len(answers) < len(socks) and time.monotonic() - t0 < 20:
            for i, sock in enumerate(socks):
                if i in answers:
                    continue
                sock.settimeout(0.01)
                try:
                    data = sock.recv(65536)
                    answers[i] = data[:12]
                except TimeoutError:
                    try:
                        sock.sendall(b" ")
                    except OSError:
                        answers[i] = b"closed"
            time.sleep(2.1 / len(socks))
        for sock in socks:
            sock.close()
    statuses = sorted(answers.values())
    assert len(answers) == 18 and time.monotonic() - t0 < 20, statuses
    assert statuses.count(b"HTTP/1.1 503") == 18 - PER_CLIENT, statuses
    assert statuses.count(b"HTTP/1.1 408") == PER_CLIENT, statuses
    watch.check()


# ---- 9: the offline API ----


def test_the_offline_api_refuses_ids_that_are_not_integers():
    with LLM(tensor_parallel_size=2, device="cpu", max_model_len=64) as llm:
        greedy = SamplingParams(max_tokens=3, temperature=0)
        expected = llm.generate({"prompt_token_ids": [1, 2, 3]}, greedy)[0].outputs[0].token_ids
        for prompt in ([1, 2.5], [1.0, 2.0], [True, False], [None], None, "x"):
            t0 = time.monotonic()
            with pytest.raises(ValueError, match="token id"):
                llm.generate({"prompt_token_ids": prompt}, greedy)
            assert time.monotonic() - t0 < 1
        assert llm.generate({"prompt_token_ids": np.array([1, 2, 3])}, greedy)[0].outputs[0].token_ids == expected
        assert llm.generate(np.array([1, 2, 3]), greedy)[0].outputs[0].token_ids == expected


# ---- 3 and 11: images ----


def png(side: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    from vision_checkpoint import PREPROCESSOR, build_vision_checkpoint

    # The pixel bounds of a real Qwen3.5 checkpoint: a large image keeps its size.
    preprocessor = {**PREPROCESSOR, "size": {"shortest_edge": 1024, "longest_edge": 16777216}}
    path = build_vision_checkpoint(tmp_path_factory.mktemp("hostile_vision"), seed=3, preprocessor=preprocessor)
    with ServeProcess(str(path), "--tp", "2", "--max-model-len", "512", "--max-num-seqs", "16") as server:
        server.model = str(path)
        yield server


def image_chat(server, uris: list[str], text: str = "Describe", **kw) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in uris]
    return {"model": server.model, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
            "max_tokens": 3, **kw}


def test_large_images_are_refused_from_their_headers(vision_server):
    with Watch(vision_server) as watch:
        for side in (2800, 2000):
            body = image_chat(vision_server, [png(side)])  # encoding the PNG here took 0.3 s of the bound
            t0 = time.monotonic()
            r = post(vision_server, "chat/completions", body)
            assert_refused(r, 400, "context_length_exceeded")
            assert time.monotonic() - t0 < 1
        big = png(8190)
        t0 = time.monotonic()
        r = post(vision_server, "chat/completions", image_chat(vision_server, [big] * 20))
        assert r.status_code in (400, 413), r.text[:300]
        assert time.monotonic() - t0 < 5  # refused before decoding twenty 67-megapixel images
    watch.check()


def test_an_image_within_budget_is_served_once_for_n_samples(vision_server):
    with Watch(vision_server) as watch:
        r = post(vision_server, "chat/completions", image_chat(vision_server, [png(64)], n=16, temperature=1.0))
        assert r.status_code == 200, r.text[:300]
        assert len(r.json()["choices"]) == 16
    watch.check()
