"""Tokenizer, chat templates, streaming detokenisation, and the embedded default checkpoint."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import threading

import pytest
import torch

from neuron.engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from neuron.utils import default_checkpoint as default_ckpt

TEXTS = [
    "Hello, world! How are you today?",
    "The café serves crème brûlée and naïve piñatas.",
    "你好，世界！日本語のテキストも大丈夫です。",
    "Emoji: 🙂 👩‍👩‍👧 🇫🇷 🎉🎉 and ✓ marks",
    "def add(a, b):\n    return a + b\n\n\tindented\r\n",
    "  leading spaces, trailing spaces   ",
    "<think>\nreasoning\n</think>\n\nanswer <tool_call>{}</tool_call>",
    "Ünïcödé ΑΒΓ Привет مرحبا שלום 🤖",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city, e.g. Zürich or 東京",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]

CHATS = {
    "user": [{"role": "user", "content": "Hi there!"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn_reasoning": [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "Question one?"},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nAnswer one."},
        {"role": "user", "content": "Question two?"},
        {"role": "assistant", "content": "Answer two.", "reasoning_content": "kept thoughts"},
    ],
    "reasoning_alias": [
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "A.", "reasoning": "via the other field name"},
    ],
    "tools_round_trip": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18, "sky": "☁️"}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
        {"role": "assistant", "content": "It is 18 °C and noon."},
        {"role": "user", "content": "Thanks"},
    ],
    "tool_call_with_text": [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}],
        },
        {"role": "tool", "content": "cold"},
    ],
    "content_parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
        {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
    ],
    "late_system": [
        {"role": "user", "content": "a"},
        {"role": "system", "content": "b"},
        {"role": "user", "content": "c"},
    ],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEURON_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return default_ckpt.default_model_dir()


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tok(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def _hf_render(hf_tok, messages, **kw):
    return hf_tok.apply_chat_template(messages, tokenize=False, **kw)


# -- chat templates ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CHATS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True])
def test_template_matches_transformers(tok, hf_tok, name, add_generation_prompt, with_tools):
    tools = TOOLS if with_tools else None
    ours = tok.apply_chat_template(CHATS[name], add_generation_prompt=add_generation_prompt, tools=tools)
    theirs = _hf_render(hf_tok, CHATS[name], add_generation_prompt=add_generation_prompt, tools=tools)
    assert ours == theirs


@pytest.mark.parametrize("enable_thinking", [True, False, None])
def test_enable_thinking_matches_transformers(tok, hf_tok, enable_thinking):
    chat = CHATS["system_user"]
    ours = tok.apply_chat_template(chat, enable_thinking=enable_thinking)
    assert ours == _hf_render(hf_tok, chat, add_generation_prompt=True, enable_thinking=enable_thinking)
    empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert ours.endswith(empty_think) is (enable_thinking is False)


def test_template_shapes_the_qwen3_prompt(tok):
    out = tok.apply_chat_template(CHATS["tools_round_trip"], tools=TOOLS)
    assert out.startswith("<|im_start|>system\nUse tools when useful.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n" in out
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>' in out
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>" not in out
    assert "</tool_response>\n<tool_response>\n12:00\n</tool_response><|im_end|>\n" in out
    assert out.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
    kept = tok.apply_chat_template(CHATS["multi_turn_reasoning"], add_generation_prompt=False)
    assert "old thoughts" not in kept and "Answer one." in kept
    assert "<|im_start|>assistant\n<think>\nkept thoughts\n</think>\n\nAnswer two.<|im_end|>\n" in kept


def test_custom_template_file_wins_and_matches_transformers(model_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    for f in model_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}{{ eos_token }}\n"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
        "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}{{ strftime_now('%Y') | length }}"
        "{% if add_generation_prompt %}>>{{ greeting }}{% endif %}"
    )
    ours = Tokenizer.from_dir(tmp_path).apply_chat_template(CHATS["system_user"], tools=TOOLS, greeting="héllo")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    theirs = _hf_render(hf, CHATS["system_user"], tools=TOOLS, add_generation_prompt=True, greeting="héllo")
    assert ours == theirs
    assert ours.startswith("[SYSTEM] You are terse.<|im_end|>\n") and ours.endswith("4>>héllo")


def test_chatml_fallback_without_template(model_dir, tmp_path):
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template is None
    chat = CHATS["content_parts"] + [{"role": "assistant", "content": "ok"}]
    assert tok.apply_chat_template(chat) == (
        "<|im_start|>system\nBe kind.<|im_end|>\n"
        "<|im_start|>user\nfirst\nsecond<|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(CHATS["user"], add_generation_prompt=False) == (
        "<|im_start|>user\nHi there!<|im_end|>\n"
    )


@pytest.mark.parametrize(
    "template, match",
    [
        ("{{ raise_exception('only user turns, please') }}", "only user turns, please"),
        ("{% for m in messages %}{{ m.content", "chat template failed"),
        ("{{ messages[0].content.nope() }}", "chat template failed"),
        ("{{ ''.__class__.__mro__ }}", "chat template failed"),
    ],
)
def test_template_errors_are_tokenizer_errors(tok, template, match):
    broken = Tokenizer(tok._backend, eos_token="<|im_end|>", chat_template=template)
    with pytest.raises(TokenizerError, match=match):
        broken.apply_chat_template(CHATS["user"])


def test_bad_chats_are_tokenizer_errors(tok):
    with pytest.raises(TokenizerError, match="unsupported message role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(TokenizerError, match="at least one message"):
        tok.apply_chat_template([])
    with pytest.raises(TokenizerError, match="objects with a role"):
        tok.apply_chat_template(["hello"])
    assert isinstance(TokenizerError("x"), ValueError)


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# -- tokenizer --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_agreement_with_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == hf_tok.encode(text, add_special_tokens=False)


def test_special_and_added_tokens(tok, hf_tok):
    im_end, eot, think = (tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<think>"))
    assert tok.eos_token_id == im_end
    assert tok.is_special(im_end) and tok.is_special(eot) and not tok.is_special(think)
    assert tok.id_to_token(think) == "<think>" and tok.id_to_token(-1) is None
    ids = tok.encode("<|im_start|>user\nhi<think>x</think><|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == im_end
    assert tok.decode(ids) == "user\nhi<think>x</think>"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<think>x</think><|im_end|>"
    assert tok.vocab_size == len(hf_tok)
    with pytest.raises(TokenizerError):
        tok.decode([-5])


# -- incremental detokenisation ---------------------------------------------------------------


def _stream(tok, ids, prompt_ids=(), skip=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def test_split_emoji_is_held_until_complete(tok):
    ids = tok.encode("a🙂b")
    assert len(ids) > 3  # the emoji spans several byte tokens in this vocabulary
    deltas = _stream(tok, ids)
    assert "".join(deltas) == "a🙂b"
    assert [d for d in deltas if d] == ["a", "🙂", "b"]


@pytest.mark.parametrize("skip", [True, False])
def test_stream_of_real_text_equals_decode_and_never_splits(tok, skip):
    rng = random.Random(1234)
    pieces = [tok.encode(t) for t in TEXTS] + [[tok.token_to_id("<|im_end|>")], [tok.token_to_id("<think>")]]
    for _ in range(60):
        ids = [i for _ in range(rng.randint(1, 6)) for i in rng.choice(pieces)]
        ids = ids[: rng.randint(1, len(ids))]  # may cut a character in half at the very end
        prompt = tok.encode(rng.choice(TEXTS))
        deltas = _stream(tok, ids, prompt_ids=prompt, skip=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas[:-1])


def test_stream_of_random_ids_equals_decode(tok):
    rng = random.Random(99)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        assert "".join(_stream(tok, ids)) == tok.decode(ids)


def test_detokeniser_window_stays_small(tok):
    class Recording:
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            self.longest = max(self.longest, len(ids))
            return tok.decode(ids, skip_special_tokens)

    rec = Recording()
    ids = tok.encode(" ".join(TEXTS) * 20)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(rec, tok.encode("prompt " * 100))
    out = "".join(detok.push(i) for i in ids) + detok.flush()
    assert out == tok.decode(ids)
    assert rec.longest <= 24


# -- the default checkpoint -------------------------------------------------------------------


def _digests(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_default_checkpoint_is_deterministic(model_dir, tmp_path):
    rebuilt = tmp_path / "again"
    rebuilt.mkdir()
    default_ckpt.build_checkpoint(rebuilt)
    assert _digests(rebuilt) == _digests(model_dir)
    assert sorted(_digests(model_dir)) == sorted(default_ckpt.FILES)


def test_default_checkpoint_files(model_dir, tok):
    cfg = json.loads((model_dir / "config.json").read_text())
    gen = json.loads((model_dir / "generation_config.json").read_text())
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert tok.vocab_size == 1385
    assert cfg["vocab_size"] == 1408  # padded to a multiple of 64
    assert (cfg["model_type"], cfg["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (eot, im_end)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    assert gen["eos_token_id"] == [im_end, eot] and (gen["temperature"], gen["top_p"], gen["top_k"]) == (0.6, 0.95, 20)
    assert (tcfg["eos_token"], tcfg["pad_token"]) == ("<|im_end|>", "<|endoftext|>")
    decoder = {v["content"]: v["special"] for v in tcfg["added_tokens_decoder"].values()}
    assert decoder == {
        "<|endoftext|>": True,
        "<|im_start|>": True,
        "<|im_end|>": True,
        "<tool_call>": False,
        "</tool_call>": False,
        "<think>": False,
        "</think>": False,
    }
    backend = json.loads((model_dir / "tokenizer.json").read_text())
    assert backend["model"]["type"] == "BPE" and backend["decoder"]["type"] == "ByteLevel"


def test_transformers_loads_the_default_checkpoint(model_dir):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, cfg.vocab_size) and torch.isfinite(logits).all()


def test_default_dir_is_reused_and_repaired(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_CACHE_DIR", str(model_dir.parent))
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert default_ckpt.default_model_dir() == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp

    monkeypatch.setenv("NEURON_CACHE_DIR", str(tmp_path))
    broken = tmp_path / default_ckpt.NAME
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    assert default_ckpt.default_model_dir() == broken
    assert _digests(broken) == _digests(model_dir)
    assert [p.name for p in tmp_path.iterdir()] == [default_ckpt.NAME]


def test_concurrent_builds_agree(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_CACHE_DIR", str(tmp_path))
    results, barrier = [], threading.Barrier(3)

    def build():
        barrier.wait()
        results.append(default_ckpt.default_model_dir())

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / default_ckpt.NAME] * 3
    assert _digests(results[0]) == _digests(model_dir)
    assert [p.name for p in tmp_path.iterdir()] == [default_ckpt.NAME]


def test_cache_root_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("NEURON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_ckpt.cache_root() == tmp_path / "xdg" / "neuron"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_ckpt.cache_root() == tmp_path / "home" / ".cache" / "neuron"
    monkeypatch.setenv("NEURON_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_ckpt.cache_root() == tmp_path / "explicit"


def test_a_tokenizer_failing_on_ordinary_text_is_refused_at_load_and_a_panic_is_its_error():
    """A tokenizer whose files are corrupt where its loader does not look (a precompiled character
    map's tables: the library then panics on some text, and a Rust panic is a BaseException no
    handler expects) is refused when it loads, by a text of many scripts; a panic at a request is
    that request's TokenizerError."""
    from neuron.engine.tokenizer import _check_runs, _no_panic

    class PanicException(BaseException):
        """The name pyo3 gives a Rust panic."""

    class FailsOnKanji:  # a backend whose map is corrupt where one CJK character maps
        def __init__(self, exc):
            self.exc = exc

        def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list:
            if any("\u4e01" in t for t in texts):
                raise self.exc("corrupt")
            return []

    for exc in (ValueError, PanicException):
        FailsOnKanji(exc).encode_batch(["plain text"], False)
        with pytest.raises(TokenizerError, match="fails on ordinary text of many scripts.*corrupt"):
            _check_runs(FailsOnKanji(exc))
    with pytest.raises(TokenizerError, match="the tokenizer failed on this text: boom"), _no_panic():
        raise PanicException("boom")
    with pytest.raises(KeyboardInterrupt), _no_panic():
        raise KeyboardInterrupt
