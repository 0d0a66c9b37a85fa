"""Classification models and cross-encoders: a *ForSequenceClassification checkpoint's head, or
named tokens' rows of a causal LM's head (Qwen3-Reranker's way), over the last token, equal to
transformers at tp 1 and 2; pairs encoded as transformers encodes them; /classify, and /score and
/rerank as a cross-encoder through the server, with what they refuse."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from checkpoints import BASE, build_checkpoint, cached_model, model_config
from server_harness import LiveServer, client, real_engine

from neuron import LLM, PoolingParams
from neuron.engine.tokenizer import Tokenizer
from neuron.errors import ConfigError, NeuronError

TEXTS = ["the quick brown fox", "jumps over the lazy dog", "a", "hello there, how are you today?"]
QUERY = "what does the fox do"
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["Ġno", "Ġyes"],
            "is_original_qwen3_reranker": True}


def _with_tokenizer(path):
    from neuron.utils.default_checkpoint import default_model_dir

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, path / name)
    return path


def _vocab() -> int:
    from neuron.utils.default_checkpoint import default_model_dir

    return Tokenizer.from_dir(default_model_dir()).vocab_size


def _build_classifier(path, seed: int, labels: int, **overrides):
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(seed)
    names = {i: f"class_{i}" for i in range(labels)}
    config = Qwen3Config(**{**BASE, "vocab_size": _vocab(), "num_labels": labels, "id2label": names,
                            "label2id": {v: k for k, v in names.items()}, **overrides})
    model = Qwen3ForSequenceClassification(config).eval()
    with torch.no_grad():  # logits of a usable size: scores away from 0 and 1, labels well apart
        model.score.weight.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return _with_tokenizer(path)


@pytest.fixture(scope="module")
def three_labels(tmp_path_factory):
    return _build_classifier(tmp_path_factory.mktemp("cls3"), seed=7, labels=3)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return _build_classifier(tmp_path_factory.mktemp("cls1"), seed=8, labels=1, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory):
    return _with_tokenizer(build_checkpoint(tmp_path_factory.mktemp("reranker"), seed=9, vocab_size=_vocab()))


def _ids(path, text: str, pair: str | None = None) -> list[int]:
    from tokenizers import Tokenizer as Backend

    return Backend.from_file(str(path / "tokenizer.json")).encode(text, pair).ids


def _logits(path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    with torch.no_grad():
        return cached_model(AutoModelForSequenceClassification, path)(input_ids=torch.tensor([ids])).logits[0]


def _reranker_logit(path, ids: list[int]) -> float:
    """Qwen3-Reranker's score as its model card computes it, before the sigmoid: the causal LM's
    last-token logit of " yes" less that of " no"."""
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_dir(path)
    with torch.no_grad():
        last = cached_model(AutoModelForCausalLM, path)(input_ids=torch.tensor([ids])).logits[0, -1]
    return float(last[tok.token_to_id("Ġyes")] - last[tok.token_to_id("Ġno")])


# ---- what a checkpoint is served for ----


def test_a_sequence_classification_checkpoint_classifies(three_labels, causal_lm):
    cfg = model_config(three_labels)
    assert cfg.tasks == {"classify"} and cfg.pooling.mode == "lasttoken" and not cfg.pooling.normalize
    head = cfg.pooling.classifier
    assert head.labels == ("class_0", "class_1", "class_2") and head.num_labels == 3
    assert torch.equal(head.weight, cached_model_score(three_labels))
    assert model_config(causal_lm).tasks == {"generate"}
    reranker = model_config(causal_lm, hf_overrides=RERANKER).pooling.classifier
    assert reranker.labels == ("Ġyes",) and reranker.weight.shape == (1, BASE["hidden_size"])


def cached_model_score(path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")["score.weight"].float()


def test_the_command_line_and_a_models_file_take_classify():
    from neuron.engine.host import ModelSpec
    from neuron.entrypoints import serve
    from neuron.entrypoints.cli import _parser

    engine, _ = serve.configs(_parser().parse_args(["serve", "some-reranker", "--task", "classify", "--hf-overrides",
                                                    json.dumps(RERANKER)]))
    assert engine.task == "classify" and engine.hf_overrides == RERANKER
    spec = ModelSpec.parse({"name": "r", "model": "some-reranker", "task": "classify", "hf_overrides": RERANKER},
                           engine, "entry 1")
    assert (spec.engine.task, spec.engine.hf_overrides) == ("classify", RERANKER)


def test_how_a_pair_becomes_one_input_follows_the_head_unless_the_config_says(causal_lm, cross_encoder):
    """vLLM's `use_sep_token`: a checkpoint's own head is a cross-encoder's (the pair template), a head
    from named tokens a language model's (one text); config.json (or --hf-overrides) decides over both."""
    assert model_config(cross_encoder).pooling.classifier.sep is True
    assert model_config(causal_lm, hf_overrides=RERANKER).pooling.classifier.sep is False
    assert model_config(causal_lm, hf_overrides={**RERANKER, "use_sep_token": True}).pooling.classifier.sep is True
    assert model_config(cross_encoder, hf_overrides={"use_pad_token": False}).pooling.classifier.sep is False
    with pytest.raises(ConfigError, match="use_sep_token must be true or false"):
        model_config(cross_encoder, hf_overrides={"use_sep_token": "no"})


@pytest.mark.parametrize("overrides, task, refused", [
    ({}, "classify", "needs `score.weight`"),
    ({"classifier_from_token": ["Ġno", "certainly not a token"]}, "auto", "'certainly not a token' is not a token"),
    ({"classifier_from_token": "Ġyes"}, "auto", "must be a non-empty list"),
    ({"classifier_from_token": ["Ġno", "Ġyes", "a"], "is_original_qwen3_reranker": True}, "auto",
     "two-way softmax head takes two tokens"),
])
def test_a_head_that_cannot_be_built_is_refused_before_any_rank_starts(causal_lm, overrides, task, refused):
    with pytest.raises(ConfigError, match=refused):
        model_config(causal_lm, hf_overrides=overrides or None, task=task)


def test_a_classifier_without_an_lm_head_does_not_generate(cross_encoder, three_labels):
    """Served for generation, an untied classifier would take its tokens from the embedding
    matrix: refused, saying what it is for. A tied one has its head in its embeddings."""
    with pytest.raises(ConfigError, match="no LM head .* cannot generate"):
        model_config(cross_encoder, task="generate")
    assert model_config(three_labels, task="generate").tasks == {"generate"}


def test_a_head_of_the_wrong_shape_is_refused(tmp_path, three_labels):
    from safetensors.torch import load_file, save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(three_labels / name, tmp_path / name)
    weights = load_file(three_labels / "model.safetensors")
    weights["score.weight"] = weights["score.weight"][:, :-1].contiguous()
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"score.weight has shape \[3, 63\]; expected \[num_labels, 64\]"):
        model_config(tmp_path)


# ---- offline: equal to transformers ----


@pytest.mark.parametrize("tp", [1, 2])
def test_classify_equals_transformers(three_labels, tp):
    with LLM(str(three_labels), device="cpu", dtype="float32", tensor_parallel_size=tp) as llm:
        outs = llm.classify(TEXTS)
        raw = llm.classify({"prompt_token_ids": _ids(three_labels, TEXTS[1])},
                           pooling_params=PoolingParams(use_activation=False))
        with pytest.raises(NeuronError, match="does not embed"):
            llm.embed(TEXTS[0])
        with pytest.raises(NeuronError, match="scoring a pair needs a one-label head"):
            llm.score(QUERY, TEXTS)
    for text, out in zip(TEXTS, outs):
        assert out.prompt_token_ids == _ids(three_labels, text)
        want = _logits(three_labels, out.prompt_token_ids)
        assert out.outputs.probs == pytest.approx(want.softmax(-1).tolist(), abs=1e-5)
    assert raw[0].outputs.probs == pytest.approx(_logits(three_labels, _ids(three_labels, TEXTS[1])).tolist(),
                                                 abs=1e-4)


def test_a_llama_classifier_at_tp2_equals_transformers(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(11)
    shape = {k: v for k, v in BASE.items() if k not in ("head_dim",)}
    model = LlamaForSequenceClassification(LlamaConfig(**{**shape, "vocab_size": _vocab(), "num_labels": 2,
                                                          "head_dim": BASE["head_dim"]})).eval()
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    _with_tokenizer(tmp_path)
    with LLM(str(tmp_path), device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        outs = llm.classify([{"prompt_token_ids": p} for p in ([5], [9, 8, 7, 6] * 10)])
    for out in outs:
        with torch.no_grad():
            want = model(input_ids=torch.tensor([out.prompt_token_ids])).logits[0].softmax(-1)
        assert out.outputs.probs == pytest.approx(want.tolist(), abs=1e-5)


def test_a_cross_encoder_scores_each_pair_as_one_input(cross_encoder):
    with LLM(str(cross_encoder), device="cpu", dtype="float32") as llm:
        one = llm.score(QUERY, TEXTS)
        pairwise = llm.score(TEXTS[:2], TEXTS[2:], pooling_params=PoolingParams(use_activation=False))
        with pytest.raises(ValueError, match="pairs of texts"):
            llm.score({"prompt_token_ids": [1, 2]}, TEXTS[0])
    for out, text in zip(one, TEXTS):
        assert out.prompt_token_ids == _ids(cross_encoder, QUERY, text)
        assert out.outputs.score == pytest.approx(float(_logits(cross_encoder, out.prompt_token_ids)[0].sigmoid()),
                                                  abs=1e-5)
    for out, (a, b) in zip(pairwise, zip(TEXTS[:2], TEXTS[2:])):
        assert out.outputs.score == pytest.approx(float(_logits(cross_encoder, _ids(cross_encoder, a, b))[0]),
                                                  abs=1e-4)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_reranker_scored_by_named_tokens_equals_its_causal_lm(causal_lm, tp):
    """Qwen3-Reranker's way: the sigmoid of " yes" against " no" at the last token, from the causal
    LM's own head; with two labels (no two-way softmax) the softmax of the two logits."""
    with LLM(str(causal_lm), device="cpu", dtype="float32", tensor_parallel_size=tp, hf_overrides=RERANKER) as llm:
        scores = llm.score(QUERY, TEXTS)
    for out, text in zip(scores, TEXTS):
        assert out.prompt_token_ids == _ids(causal_lm, QUERY + text)  # an LLM reranker reads one text, as vLLM
        assert out.outputs.score == pytest.approx(torch.tensor(_reranker_logit(causal_lm, out.prompt_token_ids))
                                                  .sigmoid().item(), abs=1e-5)
    two = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["Ġno", "Ġyes"]}
    with LLM(str(causal_lm), device="cpu", dtype="float32", hf_overrides=two) as llm:
        [out] = llm.classify(TEXTS[3])
    d = _reranker_logit(causal_lm, out.prompt_token_ids)
    assert out.outputs.probs == pytest.approx(torch.tensor([0.0, d]).softmax(-1).tolist(), abs=1e-5)


def test_a_gguf_reranker_reads_its_tokens_rows_dequantized(tmp_path):
    """A causal LM reranker as a GGUF file (the usual way llama.cpp's users have Qwen3-Reranker),
    its head a Q8_0 `output.weight`: the named tokens' rows dequantized, equal to transformers on
    the same file."""
    from gguf_files import write_gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = _with_tokenizer(build_checkpoint(tmp_path / "hf", seed=12, vocab_size=_vocab(), tie_word_embeddings=False))
    (tmp_path / "gguf").mkdir()
    path = write_gguf(hf, tmp_path / "gguf" / "reranker.gguf", {"output.weight": "Q8_0", "default": "F32"})
    with LLM(str(path), device="cpu", dtype="float32", hf_overrides=RERANKER) as llm:
        scores = llm.score(QUERY, TEXTS[:2])
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 config=AutoConfig.from_pretrained(hf)).eval()
    tok = Tokenizer.from_dir(hf)
    yes, no = tok.token_to_id("Ġyes"), tok.token_to_id("Ġno")
    for out in scores:
        with torch.no_grad():
            last = model(input_ids=torch.tensor([out.prompt_token_ids])).logits[0, -1]
        assert out.outputs.score == pytest.approx(float((last[yes] - last[no]).sigmoid()), abs=1e-5)
    with pytest.raises(ConfigError, match="a GGUF file without a classification head"):
        model_config(path, task="classify")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_gguf_reranker_as_llama_cpp_converts_it_scores_its_rerank_prompt(tmp_path, tp):
    """Qwen3-Reranker as llama.cpp's converter writes it: rank pooling, the LM head's `yes` and `no`
    rows as `cls.output` (the head left out), and a `rerank` template that llama-server fills with
    the query and the document. Served as a reranker by itself: each pair is that prompt, scored as
    the softmax of the two rows takes the first, equal to transformers' causal LM on it."""
    from gguf_files import write_gguf
    from transformers import AutoModelForCausalLM

    hf = _with_tokenizer(build_checkpoint(tmp_path / "hf", seed=13, vocab_size=_vocab(), tie_word_embeddings=False))
    template = "<|im_start|>user\nJudge: {query} || {document}<|im_end|>\n<|im_start|>assistant\n"
    (tmp_path / "gguf").mkdir()
    path = write_gguf(hf, tmp_path / "gguf" / "reranker.gguf", "F32", reranker=("Ġyes", "Ġno", template))
    config = model_config(path)
    assert config.tasks == {"classify"} and config.pooling.classifier.labels == ("yes",)
    if tp == 1:  # a template missing a placeholder would score every pair alike: refused by name
        (tmp_path / "bad").mkdir()
        bad = write_gguf(hf, tmp_path / "bad" / "reranker.gguf", "F32", reranker=("Ġyes", "Ġno", "Judge {query}"))
        with pytest.raises(ConfigError, match="tokenizer.chat_template.rerank must be a text holding"):
            model_config(bad)
    query = "what does the fox do? {document}"  # a placeholder inside a text is not filled again
    with LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=tp) as llm:
        scores = llm.score(query, TEXTS[:3])
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tok = Tokenizer.from_dir(hf)
    yes, no = tok.token_to_id("Ġyes"), tok.token_to_id("Ġno")
    for text, out in zip(TEXTS, scores):
        prompt = template.replace("{document}", text).replace("{query}", query)
        assert out.prompt_token_ids == tok.encode(prompt)
        with torch.no_grad():
            last = model(input_ids=torch.tensor([out.prompt_token_ids])).logits[0, -1]
        assert out.outputs.score == pytest.approx(float((last[yes] - last[no]).sigmoid()), abs=1e-5)
    if tp == 1:  # llama-server's /rerank, and vLLM's, make the same prompt
        with LiveServer(real_engine(str(path), tp=1, name="ranker")) as server:
            server.wait_ready()
            r = httpx.post(f"{server.url}/rerank", json={"query": query, "documents": TEXTS[:3]})
            assert r.status_code == 200, r.text
            got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
            assert [got[i] for i in range(3)] == pytest.approx([o.outputs.score for o in scores], abs=1e-6)


# ---- pairs as transformers encodes them ----


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """The default tokenizer with a post-processor that marks a pair (BOS A SEP B SEP), as
    BERT-style tokenizers do."""
    from neuron.utils.default_checkpoint import default_model_dir

    path = tmp_path_factory.mktemp("pair-template")
    spec = json.loads((default_model_dir() / "tokenizer.json").read_text())
    start, end = {"id": "<|im_start|>", "ids": [1379], "tokens": ["<|im_start|>"]}, \
        {"id": "<|im_end|>", "ids": [1380], "tokens": ["<|im_end|>"]}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}},
                 {"SpecialToken": {"id": "<|im_end|>", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": start, "<|im_end|>": end}}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(default_model_dir() / "tokenizer_config.json", path / "tokenizer_config.json")
    return path


@pytest.mark.parametrize("a, b, max_tokens", [
    ("the quick brown fox", "jumps over the lazy dog", None),
    ("the quick brown fox", "jumps over the lazy dog", 9),  # both cut: the shorter to half the room
    ("a b c d e f g h i j k l", "x", 7),  # the longer cut alone
    ("x y z", "a b c d e f g h i j k l", 12),
    ("one two three four", "five six seven eight", 7),  # level: the first keeps the smaller half
])
def test_a_pair_is_encoded_and_cut_as_transformers_does(templated, a, b, max_tokens):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(templated)
    cut = {} if max_tokens is None else {"truncation": "longest_first", "max_length": max_tokens}
    want = hf(a, b, return_token_type_ids=True, **cut)
    tok = Tokenizer.from_dir(templated)
    got, types_from = tok.encode_pair(a, b, max_tokens)
    assert got == want["input_ids"] and types_from is None  # a model of one token type reads none
    tok.typed_pairs = True  # as an encoder with two sets it (model_config)
    got, types_from = tok.encode_pair(a, b, max_tokens)
    assert [int(k >= types_from) for k in range(len(got))] == want["token_type_ids"]
    assert got[0] == 1379 and got[-1] == 1380 and got.count(1380) == 2
    if max_tokens is not None:
        assert len(got) == max_tokens


@pytest.mark.parametrize("max_tokens", [None, 12, 4])
def test_one_text_is_bounded_as_transformers_truncates_it(templated, max_tokens):
    from transformers import AutoTokenizer

    text = "the quick brown fox jumps over the lazy dog"
    cut = {} if max_tokens is None else {"truncation": True, "max_length": max_tokens}
    tok = Tokenizer.from_dir(templated)
    assert tok.join_single(tok.encode(text), max_tokens) == AutoTokenizer.from_pretrained(templated)(text, **cut)[
        "input_ids"]


def test_a_bound_that_leaves_the_texts_no_room_is_refused(templated):
    from neuron.engine.tokenizer import TokenizerError

    with pytest.raises(TokenizerError, match="4 tokens leave no room"):
        Tokenizer.from_dir(templated).encode_pair("a b", "c d", 4)


# ---- served ----


@pytest.fixture(scope="module")
def rerank_server(cross_encoder):
    engine = real_engine(str(cross_encoder), tp=2, name="ranker", max_model_len=64)
    with LiveServer(engine) as server:
        yield server.wait_ready()


def _sigmoid_of(path, a: str, b: str) -> float:
    return float(_logits(path, _ids(path, a, b))[0].sigmoid())


def test_score_and_rerank_as_a_cross_encoder(rerank_server, cross_encoder):
    url = rerank_server.url
    want = [_sigmoid_of(cross_encoder, QUERY, t) for t in TEXTS]
    r = httpx.post(f"{url}/v1/score", json={"model": "ranker", "text_1": QUERY, "text_2": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(len(_ids(cross_encoder, QUERY, t)) for t in TEXTS)
    raw = httpx.post(f"{url}/score", json={"model": "ranker", "text_1": TEXTS[:2], "text_2": TEXTS[2:],
                                           "use_activation": False}).json()
    assert [d["score"] for d in raw["data"]] == pytest.approx(
        [float(_logits(cross_encoder, _ids(cross_encoder, a, b))[0]) for a, b in zip(TEXTS[:2], TEXTS[2:])], abs=1e-4)
    best = sorted(range(len(TEXTS)), key=want.__getitem__, reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank", "/reranking", "/v1/reranking"):
        ranked = httpx.post(f"{url}{path}", json={"model": "ranker", "query": QUERY, "documents": TEXTS,
                                                  "top_n": 3}).json()
        assert [r["index"] for r in ranked["results"]] == best[:3], path
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([want[k] for k in best[:3]],
                                                                                  abs=1e-5)
        assert [r["document"]["text"] for r in ranked["results"]] == [TEXTS[k] for k in best[:3]]


def test_classify_route(rerank_server, cross_encoder):
    r = httpx.post(f"{rerank_server.url}/classify", json={"model": "ranker", "input": TEXTS[:2]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "ranker" and body["id"].startswith("classify-")
    for d, text in zip(body["data"], TEXTS[:2]):
        assert d["num_classes"] == 1 and d["label"] == "class_0"
        assert d["probs"] == pytest.approx([float(_logits(cross_encoder, _ids(cross_encoder, text))[0].sigmoid())],
                                           abs=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(len(_ids(cross_encoder, t)) for t in TEXTS[:2])


def test_a_long_pair_is_cut_to_the_bound_or_refused(rerank_server, cross_encoder):
    url = rerank_server.url
    long_doc = " ".join(["lazy dog"] * 80)
    r = httpx.post(f"{url}/v1/score", json={"model": "ranker", "text_1": QUERY, "text_2": long_doc})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    cut = httpx.post(f"{url}/v1/score", json={"model": "ranker", "text_1": QUERY, "text_2": long_doc,
                                              "truncate_prompt_tokens": 20})
    assert cut.status_code == 200, cut.text
    ids, _ = Tokenizer.from_dir(cross_encoder).encode_pair(QUERY, long_doc, 20)
    assert len(ids) == 20 and ids[: len(_ids(cross_encoder, QUERY))] == _ids(cross_encoder, QUERY)
    assert cut.json()["data"][0]["score"] == pytest.approx(float(_logits(cross_encoder, ids)[0].sigmoid()), abs=1e-5)
    assert cut.json()["usage"]["prompt_tokens"] == 20
    whole = httpx.post(f"{url}/v1/score", json={"model": "ranker", "text_1": QUERY, "text_2": long_doc,
                                                "truncate_prompt_tokens": -1})
    assert whole.status_code == 200 and whole.json()["usage"]["prompt_tokens"] == 64, whole.text


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/embeddings", {"input": "hi"}, 400, "model", "model_not_embedding"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, 400, "model", "model_not_generative"),
    ("/v1/score", {"text_1": QUERY, "text_2": "x", "truncate_prompt_tokens": 1}, 400, "truncate_prompt_tokens",
     None),
    ("/v1/score", {"text_1": QUERY, "text_2": "x", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens",
     None),
    ("/classify", {"input": []}, 400, "input", None),
    ("/classify", {"input": [[1, 99999]]}, 400, "input", None),
    ("/rerank", {"query": "q", "documents": []}, 400, "documents", None),
])
def test_what_a_cross_encoder_refuses(rerank_server, path, body, status, param, code):
    r = httpx.post(f"{rerank_server.url}{path}", json={"model": "ranker", **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    # the server goes on serving
    ok = httpx.post(f"{rerank_server.url}/classify", json={"model": "ranker", "input": "a"})
    assert ok.status_code == 200


def test_the_openai_client_is_refused_chat_on_a_classifier(rerank_server):
    import openai

    with pytest.raises(openai.BadRequestError, match="is a classification model"):
        client(rerank_server).chat.completions.create(model="ranker", messages=[{"role": "user", "content": "hi"}])


def test_only_a_one_label_head_scores_pairs(three_labels):
    engine = real_engine(str(three_labels), tp=1, name="three")
    with LiveServer(engine) as server:
        url = server.wait_ready().url
        r = httpx.post(f"{url}/v1/rerank", json={"model": "three", "query": "q", "documents": ["d"]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_cross_encoder", r.text
        ok = httpx.post(f"{url}/classify", json={"model": "three", "input": [[5, 6, 7]]}).json()
        assert ok["data"][0]["num_classes"] == 3
        assert ok["data"][0]["probs"] == pytest.approx(_logits(three_labels, [5, 6, 7]).softmax(-1).tolist(), abs=1e-5)
        label = int(_logits(three_labels, [5, 6, 7]).argmax())
        assert ok["data"][0]["label"] == f"class_{label}"


def test_an_embedding_or_generation_model_refuses_classify():
    engine = real_engine(None, tp=1, name="gen")
    with LiveServer(engine) as server:
        url = server.wait_ready().url
        r = httpx.post(f"{url}/classify", json={"model": "gen", "input": "hi"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_classifier", r.text


# ---- generated bodies: never a 500 ----

_PAIRING = ["max_tokens_per_query", "max_tokens_per_doc", "instruction", "chat_template_kwargs"]
_FIELDS = {"/v1/score": ["text_1", "text_2", "queries", "documents", "truncate_prompt_tokens", "use_activation",
                         "cache_salt", "user", *_PAIRING],
           "/v1/rerank": ["query", "documents", "top_n", "return_documents", "truncate_prompt_tokens",
                          "use_activation", "cache_salt", *_PAIRING],
           "/classify": ["input", "truncate_prompt_tokens", "use_activation", "cache_salt", "user"]}
_VALID = {"/v1/score": {"text_1": QUERY, "text_2": TEXTS[:2]}, "/v1/rerank": {"query": QUERY, "documents": TEXTS[:2]},
          "/classify": {"input": TEXTS[:2]}}


def _bodies():
    from hypothesis import strategies as st

    odd = st.one_of(st.text(max_size=30), st.sampled_from(["", "<|im_end|>", "\ud800", "\x00", " " * 300]))
    values = st.one_of(st.none(), st.booleans(), st.integers(-(2**65), 2**65), st.sampled_from([-2, -1, 0, 1, 2, 5, 64]),
                       st.floats(allow_nan=False), odd, st.lists(odd, max_size=4),
                       st.lists(st.integers(-3, 2000), max_size=5), st.lists(st.lists(st.integers(-3, 2000),
                                                                                      max_size=3), max_size=3),
                       st.dictionaries(odd, st.integers(), max_size=2))

    @st.composite
    def body(draw):
        path = draw(st.sampled_from(sorted(_FIELDS)))
        out = {"model": "ranker", **_VALID[path]}
        for _ in range(draw(st.integers(1, 3))):
            field = draw(st.sampled_from(_FIELDS[path] + ["model"]))
            if draw(st.integers(0, 5)) == 0:
                out.pop(field, None)
            else:
                out[field] = draw(values)
        return path, out

    return body()


def test_generated_bodies_never_get_a_500(rerank_server):
    from hypothesis import HealthCheck, given, settings

    @settings(deadline=None, derandomize=True, database=None, max_examples=60,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(_bodies())
    def run(case):
        path, body = case
        r = httpx.post(f"{rerank_server.url}{path}", content=json.dumps(body, allow_nan=True).encode(),
                       headers={"content-type": "application/json"}, timeout=60)
        context = f"{path} {body!r:.400} -> {r.status_code} {r.text[:400]}"
        assert r.status_code in (200, 400, 404), context
        if r.status_code != 200:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], context

    run()
    assert httpx.get(f"{rerank_server.url}/health").status_code == 200


def test_async_encode_gives_a_classifiers_probabilities(three_labels):
    """AsyncLLM.encode (vLLM's streaming offline API): a classifier's label probabilities in
    `outputs.data`, requests run together, and a prompt past the context refused before it runs."""
    import asyncio

    from neuron import AsyncLLM, PoolingParams
    from neuron.engine.input_processor import RequestError

    async def main():
        async with AsyncLLM(str(three_labels), device="cpu", dtype="float32", max_model_len=64) as llm:
            async def one(text: str, rid: str):
                return [o async for o in llm.encode(text, request_id=rid)]

            outs = await asyncio.gather(*(one(t, f"r{k}") for k, t in enumerate(TEXTS)))
            [raw] = [o async for o in llm.encode(TEXTS[0], PoolingParams(use_activation=False))]
            assert raw.outputs.data.tolist() == pytest.approx(_logits(three_labels, raw.prompt_token_ids).tolist(),
                                                              abs=1e-4)
            with pytest.raises(RequestError, match="maximum context length"):
                [o async for o in llm.encode({"prompt_token_ids": [5] * 65})]
            with pytest.raises(RequestError, match="not served for embed"):
                [o async for o in llm.encode("a", PoolingParams(task="embed"))]
            return outs

    outs = asyncio.run(main())
    for k, (text, [out]) in enumerate(zip(TEXTS, outs)):
        assert out.request_id == f"r{k}" and out.finished and out.prompt_token_ids == _ids(three_labels, text)
        want = _logits(three_labels, out.prompt_token_ids).softmax(-1)
        assert out.outputs.data.tolist() == pytest.approx(want.tolist(), abs=1e-5)


def test_an_llm_reranker_served_reads_each_pair_as_one_text(causal_lm, monkeypatch):
    """Qwen3-Reranker's way through the server: the query and each document joined as one text,
    scored by " yes" against " no"; truncate_prompt_tokens keeps the joined text's start; the text a
    request may have tokenized is bounded."""
    from neuron.entrypoints.openai import serving_score

    engine = real_engine(str(causal_lm), tp=2, name="llm-ranker", max_model_len=64, hf_overrides=RERANKER)
    with LiveServer(engine) as server:
        url = server.wait_ready().url
        ranked = httpx.post(f"{url}/v1/rerank", json={"model": "llm-ranker", "query": QUERY, "documents": TEXTS})
        assert ranked.status_code == 200, ranked.text
        want = [float(torch.tensor(_reranker_logit(causal_lm, _ids(causal_lm, QUERY + t))).sigmoid()) for t in TEXTS]
        got = {r["index"]: r["relevance_score"] for r in ranked.json()["results"]}
        assert [got[k] for k in range(len(TEXTS))] == pytest.approx(want, abs=1e-5)
        long_doc = " lazy dog" * 80
        cut = httpx.post(f"{url}/v1/score", json={"model": "llm-ranker", "text_1": QUERY, "text_2": long_doc,
                                                  "truncate_prompt_tokens": 16}).json()
        head = _ids(causal_lm, QUERY + long_doc)[:16]
        assert cut["usage"]["prompt_tokens"] == 16
        assert cut["data"][0]["score"] == pytest.approx(
            float(torch.tensor(_reranker_logit(causal_lm, head)).sigmoid()), abs=1e-5)
        monkeypatch.setattr(serving_score, "MAX_JOINED_CHARS", 100)
        r = httpx.post(f"{url}/v1/rerank", json={"model": "llm-ranker", "query": QUERY * 3, "documents": TEXTS})
        assert r.status_code == 400 and "characters of text to tokenize" in r.json()["error"]["message"], r.text


SCORE_TEMPLATE = ("{% for m in messages %}{% if m.role == 'query' %}Query: {{ m.content }}\n"
                  "{% else %}Document: {{ m.content }}\nRelevant:{% endif %}{% endfor %}")


def _scored_text(query: str, document: str) -> str:
    return f"Query: {query}\nDocument: {document}\nRelevant:"


def test_a_score_template_renders_each_pair(causal_lm, cross_encoder):
    """vLLM's score templates: a pair rendered as a query message and a document message, then
    encoded as one text; given to LLM.score, or to the server as --chat-template (a cross-encoder's
    pairs too, in place of the tokenizer's pair template)."""
    with LLM(str(causal_lm), device="cpu", dtype="float32", hf_overrides=RERANKER) as llm:
        offline = llm.score(QUERY, TEXTS[:2], chat_template=SCORE_TEMPLATE)
    for out, text in zip(offline, TEXTS):
        assert out.prompt_token_ids == _ids(causal_lm, _scored_text(QUERY, text))
        assert out.outputs.score == pytest.approx(
            float(torch.tensor(_reranker_logit(causal_lm, out.prompt_token_ids)).sigmoid()), abs=1e-5)
    engine = real_engine(str(cross_encoder), tp=1, name="templated-ranker", chat_template=SCORE_TEMPLATE)
    with LiveServer(engine) as server:
        body = httpx.post(f"{server.wait_ready().url}/v1/score", json={"model": "templated-ranker", "text_1": QUERY,
                                                                       "text_2": TEXTS[:2]}).json()
    ids = [_ids(cross_encoder, _scored_text(QUERY, t)) for t in TEXTS[:2]]
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    assert [d["score"] for d in body["data"]] == pytest.approx(
        [float(_logits(cross_encoder, i)[0].sigmoid()) for i in ids], abs=1e-5)


def test_queries_and_documents_cut_to_tokens_and_an_instruction_for_the_template(causal_lm):
    """vLLM's max_tokens_per_query and max_tokens_per_doc (each text cut at a token's end before
    the pair is made) and `instruction` (chat_template_kwargs' for the score template); template
    arguments where no template takes them are refused."""
    template = "{{ instruction | default('none') }}|" + SCORE_TEMPLATE
    tok = Tokenizer.from_dir(causal_lm)
    doc = "jumps over the lazy dog and runs far away"
    assert tok.encode(tok.cut(doc, 3)) == tok.encode(doc)[:3] and tok.cut(doc, 99) == doc
    engine = real_engine(str(causal_lm), tp=1, name="cut", hf_overrides=RERANKER, chat_template=template)
    with LiveServer(engine) as server:
        url = server.wait_ready().url
        body = httpx.post(f"{url}/v1/rerank", json={"model": "cut", "query": QUERY, "documents": [doc],
                                                    "max_tokens_per_query": 2, "max_tokens_per_doc": 3,
                                                    "instruction": "Judge it"}).json()
        text = "Judge it|" + _scored_text(tok.cut(QUERY, 2), tok.cut(doc, 3))
        want = float(torch.tensor(_reranker_logit(causal_lm, _ids(causal_lm, text))).sigmoid())
        assert body["results"][0]["relevance_score"] == pytest.approx(want, abs=1e-5)
        assert body["results"][0]["document"]["text"] == doc  # the document as sent
        bad = httpx.post(f"{url}/v1/score", json={"model": "cut", "text_1": "q", "text_2": "d",
                                                  "max_tokens_per_doc": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens_per_doc"
        reserved = httpx.post(f"{url}/v1/score", json={"model": "cut", "text_1": "q", "text_2": "d",
                                                       "chat_template_kwargs": {"messages": []}})
        assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "chat_template_kwargs"


def test_template_arguments_without_a_score_template_are_refused(rerank_server):
    r = httpx.post(f"{rerank_server.url}/v1/rerank", json={"model": "ranker", "query": "q", "documents": ["d"],
                                                           "instruction": "Judge it"})
    assert r.status_code == 400 and "score template" in r.json()["error"]["message"], r.text
