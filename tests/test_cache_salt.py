"""Cache salts and prefix-cache isolation: requests share cached prefix blocks only when their salts
match (vLLM's `cache_salt`), in the block manager, the offline API and the HTTP API, and the
server's --prefix-cache-isolation modes decide which salt each request carries."""

from __future__ import annotations

import logging
from contextlib import ExitStack

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from server_harness import LiveServer, Records, ScriptedEngine, client, real_engine, scripted_engine

from neuron import LLM, SamplingParams
from neuron.engine.block_manager import BlockManager, salt_key
from neuron.engine.input_processor import MAX_CACHE_SALT_CHARS, RequestError
from neuron.engine.sequence import Sequence
from neuron.entrypoints.openai.app import ServerConfig
from neuron.errors import ConfigError

BLOCK = 4


def seq(tokens: list[int], salt: str | None = None, rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), None, 16, cache_salt=salt_key(salt))


def admitted(bm: BlockManager, s: Sequence, compute: bool = True) -> Sequence:
    """Allocated, and (with `compute`) as after a step that ran all its tokens."""
    assert bm.allocate(s)
    if compute:
        s.num_computed = s.num_tokens
        bm.cache_computed(s)
    return s


# ---- the block manager ----

PROMPT = [(5 * i + 2) % 97 + 1 for i in range(11)]  # 2 full blocks of 4 and a partial one


def test_the_same_salt_shares_blocks_and_another_shares_none():
    bm = BlockManager(32, BLOCK)
    first = admitted(bm, seq(PROMPT, "alpha", "first"))
    same = admitted(bm, seq(PROMPT, "alpha", "same"), compute=False)
    assert same.num_cached_blocks == 2 and same.block_table[:2] == first.block_table[:2]
    other = admitted(bm, seq(PROMPT, "beta", "other"), compute=False)
    unsalted = admitted(bm, seq(PROMPT, None, "unsalted"), compute=False)
    for s in (other, unsalted):
        assert s.num_cached_blocks == 0 and not set(s.block_table) & set(first.block_table)
    assert len(bm.cached) == 2  # only the first request's blocks are cached


def test_a_salt_changes_every_hash_of_the_chain():
    bm = BlockManager(32, BLOCK)
    hashes = [admitted(bm, seq(PROMPT, salt, str(salt))).block_hashes for salt in (None, "alpha", "beta")]
    assert all(len(h) == 2 for h in hashes)
    for i in range(2):
        assert len({h[i] for h in hashes}) == 3


def test_unsalted_requests_share_as_before():
    bm = BlockManager(32, BLOCK)
    first = admitted(bm, seq(PROMPT, None, "first"))
    again = admitted(bm, seq(PROMPT, None, "again"), compute=False)
    assert again.num_cached_blocks == 2 and again.block_table[:2] == first.block_table[:2]


@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40),
       st.lists(st.integers(0, 2000), min_size=BLOCK + 1, max_size=6 * BLOCK))
def test_two_salts_never_share_a_block(a, b, tokens):
    bm = BlockManager(64, BLOCK)
    first = admitted(bm, seq(tokens, a, "a"))
    second = admitted(bm, seq(tokens, b, "b"), compute=False)
    if a == b:
        assert second.num_cached_blocks == (len(tokens) - 1) // BLOCK
    else:
        assert second.num_cached_blocks == 0 and not set(second.block_table) & set(first.block_table)


def test_a_salted_prompt_waits_only_for_its_own_salt():
    """The samples of one request share its salt, so the second waits for the first's prefill and
    takes it from the cache; a request of another salt computes the same tokens itself."""
    bm = BlockManager(32, BLOCK)
    running = admitted(bm, seq(PROMPT, "alpha", "sample-0"), compute=False)  # its blocks named, none computed
    assert bm.computing_elsewhere(seq(PROMPT, "alpha", "sample-1"), [running])
    assert not bm.computing_elsewhere(seq(PROMPT, "beta", "x"), [running])
    assert not bm.computing_elsewhere(seq(PROMPT, None, "y"), [running])


def test_a_sequence_keeps_a_digest_of_its_salt_not_the_salt():
    s = seq(PROMPT, "my-secret-salt")
    assert s.cache_salt == salt_key("my-secret-salt") and len(s.cache_salt) == 32
    assert "my-secret-salt" not in repr(s)
    assert salt_key("a") != salt_key("b") and salt_key(None) is None


# ---- the offline API ----

SYSTEM = [(7 * i + 3) % 290 + 1 for i in range(45)]  # 5 full blocks of 8 before the last token
CACHED = 40


@pytest.fixture(scope="module")
def llm():
    with LLM(device="cpu", dtype="float32", block_size=8) as llm:
        yield llm


def _hits(llm: LLM, prompt: dict, params: SamplingParams | None = None) -> tuple[int, list[int]]:
    """Prompt tokens found in the prefix cache while generating `prompt`, and its first output."""
    before = llm.engine.prefix_cache_counts()[1]
    out = llm.generate(prompt, params or SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    return llm.engine.prefix_cache_counts()[1] - before, out[0].outputs[0].token_ids


def test_offline_prompts_share_the_cache_only_with_their_own_salt(llm):
    prompt = SYSTEM + [11]
    first, tokens = _hits(llm, {"prompt_token_ids": prompt, "cache_salt": "tenant-a"})
    assert first == 0
    assert _hits(llm, {"prompt_token_ids": prompt, "cache_salt": "tenant-b"}) == (0, tokens)
    assert _hits(llm, {"prompt_token_ids": prompt}) == (0, tokens)
    assert _hits(llm, {"prompt_token_ids": prompt, "cache_salt": "tenant-a"}) == (CACHED, tokens)
    assert _hits(llm, {"prompt_token_ids": SYSTEM + [12], "cache_salt": "tenant-b"})[0] == CACHED
    assert _hits(llm, {"prompt_token_ids": prompt})[0] == CACHED


def test_offline_text_prompt_takes_a_salt(llm):
    text = "The river bends around the old mill, and the water runs slow and brown. " * 3
    assert _hits(llm, {"prompt": text, "cache_salt": "text-salt"})[0] == 0
    assert _hits(llm, {"prompt": text, "cache_salt": "other-salt"})[0] == 0
    length = len(llm.get_tokenizer().encode(text, add_special_tokens=True))
    assert _hits(llm, {"prompt": text, "cache_salt": "text-salt"})[0] == (length - 1) // 8 * 8 > 0


def test_the_samples_of_a_salted_prompt_share_its_prefill(llm):
    prompt = [(11 * i + 7) % 290 + 1 for i in range(20)]  # 2 full blocks before its last token
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=2, ignore_eos=True)
    assert _hits(llm, {"prompt_token_ids": prompt, "cache_salt": "n-salt"}, params)[0] == 2 * 16


@pytest.mark.parametrize("salt, says", [
    ("", "got 0 characters"),
    ("s" * (MAX_CACHE_SALT_CHARS + 1), f"got {MAX_CACHE_SALT_CHARS + 1} characters"),
    (7, "got int"),
])
def test_offline_bad_salt_is_refused_before_anything_runs(llm, salt, says):
    with pytest.raises(RequestError, match=f"cache_salt must be a non-empty string of at most "
                                           f"{MAX_CACHE_SALT_CHARS} characters, {says}") as caught:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5], "cache_salt": salt}])
    assert caught.value.param == "cache_salt"
    assert not llm.engine.has_unfinished()


def test_offline_unknown_prompt_key_is_refused(llm):
    with pytest.raises(ValueError, match="a prompt dict takes cache_salt, multi_modal_data, prompt, "
                                         "prompt_token_ids; got cache_salts"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "cache_salts": "typo"})


# ---- the HTTP API: the field, and the salt each isolation mode gives a request ----


@pytest.fixture(scope="module")
def stub_servers(default_tokenizer):
    """One scripted server per isolation mode."""
    with ExitStack() as stack:
        yield {mode: stack.enter_context(LiveServer(scripted_engine(ScriptedEngine(default_tokenizer, {})),
                                                    ServerConfig(prefix_cache_isolation=mode))).wait_ready(10)
               for mode in ("none", "api-key", "salt")}


def _salts(server, key: str | None = None, path: str = "/completions", **body) -> list[str | None]:
    """The cache salt each engine request of one API request carried."""
    engine = server.engine.engine
    before = set(engine.cache_salts)
    body = {"model": "stub", "max_tokens": 2, **body}
    body.setdefault("messages" if path == "/chat/completions" else "prompt", "Hello")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(server.base_url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return [engine.cache_salts[rid] for rid in sorted(set(engine.cache_salts) - before)]


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
@pytest.mark.parametrize("salt, says", [
    ("", "got 0 characters"),
    ("x" * (MAX_CACHE_SALT_CHARS + 1), f"got {MAX_CACHE_SALT_CHARS + 1} characters"),
    (5, "Expected `str | null`, got `int`"),
    (["a"], "Expected `str | null`, got `array`"),
])
def test_a_bad_cache_salt_is_a_400_naming_it(stub_servers, path, salt, says):
    body = {"model": "stub", "max_tokens": 2, "cache_salt": salt,
            **({"messages": [{"role": "user", "content": "Hi"}]} if path == "/chat/completions" else {"prompt": "Hi"})}
    r = httpx.post(stub_servers["none"].base_url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["type"]) == ("cache_salt", "invalid_request_error")
    assert says in error["message"]
    assert "xxxxxxxx" not in error["message"]  # a salt is never echoed


def test_none_passes_the_request_salt_through(stub_servers):
    server = stub_servers["none"]
    assert _salts(server) == [None]
    assert _salts(server, cache_salt="s1") == ["s1"]
    assert _salts(server, "k1", cache_salt="s1", n=2) == ["s1", "s1"]
    messages = [{"role": "user", "content": "Hi"}]
    assert _salts(server, path="/chat/completions", messages=messages, cache_salt="s2") == ["s2"]


def test_api_key_salts_each_request_with_its_key(stub_servers):
    server = stub_servers["api-key"]
    [k1] = _salts(server, "key-one")
    [k2] = _salts(server, "key-two")
    [keyless] = _salts(server)
    assert len({k1, k2, keyless}) == 3 and None not in (k1, k2, keyless)
    assert _salts(server, "key-one") == [k1]
    assert "key-one" not in k1  # a digest: the key itself goes nowhere
    [salted] = _salts(server, "key-one", cache_salt="s1")
    assert salted not in (k1, k2) and _salts(server, "key-one", cache_salt="s1") == [salted]
    assert _salts(server, "key-two", cache_salt="s1") != [salted]  # a salt does not cross keys
    assert _salts(server, "key-one", prompt=["a", "b"], n=2) == [k1] * 4  # one salt for all its sequences
    messages = [{"role": "user", "content": "Hi"}]
    assert _salts(server, "key-one", path="/chat/completions", messages=messages) == [k1]


def test_api_key_isolation_keeps_stored_responses_apart(stub_servers):
    """A stored response is seen (read, continued, deleted) only with the key that made it."""
    url = stub_servers["api-key"].base_url + "/responses"

    def key(k: str | None) -> dict:
        return {"authorization": f"Bearer {k}"} if k else {}

    made = httpx.post(url, json={"model": "stub", "input": "Hello"}, headers=key("key-one"), timeout=30)
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    for other in ("key-two", None):
        assert httpx.get(f"{url}/{rid}", headers=key(other)).status_code == 404
        r = httpx.post(url, json={"model": "stub", "input": "Hi", "previous_response_id": rid}, headers=key(other),
                       timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"
        assert httpx.delete(f"{url}/{rid}", headers=key(other)).status_code == 404
    assert httpx.get(f"{url}/{rid}", headers=key("key-one")).json()["id"] == rid
    r = httpx.post(url, json={"model": "stub", "input": "Hi", "previous_response_id": rid}, headers=key("key-one"),
                   timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.delete(f"{url}/{rid}", headers=key("key-one")).status_code == 200


def test_salt_gives_each_unsalted_request_a_salt_of_its_own(stub_servers):
    server = stub_servers["salt"]
    [a], [b] = _salts(server), _salts(server)
    assert a is not None and b is not None and a != b
    samples = _salts(server, n=3)
    assert len(set(samples)) == 1 and samples[0] not in (a, b)  # its samples share one
    assert _salts(server, cache_salt="team") == ["team"] == _salts(server, "any-key", cache_salt="team")


def test_api_key_isolation_with_one_configured_key_is_refused():
    with pytest.raises(ConfigError, match="--api-key makes every client present the same one"):
        ServerConfig(api_key="k", prefix_cache_isolation="api-key")
    assert ServerConfig(api_key="k", prefix_cache_isolation="salt").prefix_cache_isolation == "salt"


def test_isolation_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("NEURON_PREFIX_CACHE_ISOLATION", "SALT")
    assert ServerConfig().prefix_cache_isolation == "salt"
    monkeypatch.setenv("NEURON_PREFIX_CACHE_ISOLATION", "tenant")
    with pytest.raises(ConfigError, match="NEURON_PREFIX_CACHE_ISOLATION: expected one of none, api-key, salt"):
        ServerConfig()


# ---- the HTTP API on the model: what the modes keep apart ----

LONG_PROMPT = [(13 * i + 5) % 1300 + 3 for i in range(50)]  # 3 full blocks of 16 before its last token
SALT = "salt-5e2b8c41"
KEYS = ("key-a-93f1", "key-b-27c4")


def _prompt_hits(server, key: str, **extra) -> int:
    engine = server.engine.engine
    before = engine.prefix_cache_counts()[1]
    client(server, api_key=key).completions.create(model="neuron-default", prompt=LONG_PROMPT, max_tokens=1,
                                                   extra_body=extra)
    return engine.prefix_cache_counts()[1] - before


@pytest.fixture
def neuron_log():
    """Every record of neuron's loggers, debug ones included, while the test runs."""
    logger = logging.getLogger("neuron")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    with Records("neuron") as records:
        yield records
    logger.setLevel(level)


A, B = KEYS
SALTED = {"cache_salt": SALT}


@pytest.mark.parametrize("mode, shared, apart", [
    # after a first unsalted request with key A: (key, extra body) of requests that share its blocks,
    # and of requests that do not
    ("none", [(B, {}), (A, {})], [(A, SALTED)]),
    ("api-key", [(A, {})], [(B, {}), (A, SALTED)]),
    ("salt", [], [(A, {}), (B, {}), (A, SALTED)]),
])
def test_what_each_mode_keeps_apart_on_the_model(mode, shared, apart, neuron_log):
    with LiveServer(real_engine(None, 1, max_model_len=256), ServerConfig(prefix_cache_isolation=mode)) as server:
        server.wait_ready()
        assert _prompt_hits(server, A) == 0
        for key, extra in apart:
            assert _prompt_hits(server, key, **extra) == 0, (key, extra)
        for key, extra in shared:
            assert _prompt_hits(server, key, **extra) == 48, (key, extra)
        assert _prompt_hits(server, A, **SALTED) == 48  # the same salt shares in every mode
    logged = "\n".join(r.getMessage() for r in neuron_log.records)
    assert "request cmpl-" in logged  # the requests were logged, without their salt or key
    assert SALT not in logged and A not in logged and B not in logged
