"""Encoder models (BERT, RoBERTa, XLM-RoBERTa): embeddings, classification and cross-encoder
scores equal to transformers at tp 1 and 2 on tiny random checkpoints with WordPiece tokenizers
built here; an input runs whole in one step; what an encoder cannot do is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from checkpoints import cached_model, model_config
from server_harness import LiveServer, client, real_engine

from neuron import LLM, PoolingParams
from neuron.errors import ConfigError, NeuronError

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "what", "does", "do", "a", "cat", "sat",
         "on", "mat", "hello", "there", "how", "are", "you", "today", "?", ",", "."]
TEXTS = ["the quick brown fox", "jumps over the lazy dog", "a", "hello there, how are you today?"]
QUERY = "what does the fox do"
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=64)


def _tokenizer(path: Path, roberta: bool) -> list[str]:
    """A WordPiece tokenizer of WORDS (each letter too, as pieces), with BERT's templates ([CLS] a
    [SEP] b [SEP], the second text type 1) or RoBERTa's (<s> a </s></s> b </s>, one type)."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece
    from tokenizers.processors import TemplateProcessing

    specials = ["<s>", "<pad>", "</s>", "<unk>"] if roberta else ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = sorted({c for w in WORDS for c in w})
    vocab = {t: i for i, t in enumerate(dict.fromkeys(specials + WORDS + letters + [f"##{c}" for c in letters]))}
    cls, sep, unk = ("<s>", "</s>", "<unk>") if roberta else ("[CLS]", "[SEP]", "[UNK]")
    tok = Tokenizer(WordPiece(vocab, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    pair = f"{cls} $A {sep} {sep} $B {sep}" if roberta else f"{cls} $A {sep} $B:1 {sep}:1"
    tok.post_processor = TemplateProcessing(single=f"{cls} $A {sep}", pair=pair,
                                            special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    named = {"cls_token": cls, "sep_token": sep, "unk_token": unk, "pad_token": specials[1 if roberta else 0]}
    if not roberta:
        named["mask_token"] = "[MASK]"
    (path / "tokenizer_config.json").write_text(json.dumps(named))
    return list(vocab)


def _build(path: Path, kind: str, seed: int, labels: int = 0, st_pooling: str | None = None) -> Path:
    """A tiny random encoder: `kind` bert or xlm-roberta, the bare model (labels 0) or its
    sequence-classification model; `st_pooling` adds sentence-transformers' files (normalized)."""
    import transformers as tf

    roberta = kind == "xlm-roberta"
    path.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(path, roberta)
    torch.manual_seed(seed)
    extra = {"num_labels": labels} if labels else {}
    if kind == "distilbert":
        config = tf.DistilBertConfig(vocab_size=len(vocab), dim=SHAPE["hidden_size"], n_layers=2, n_heads=4,
                                     hidden_dim=128, max_position_embeddings=64, pad_token_id=0, **extra)
        model = (tf.DistilBertForSequenceClassification if labels else tf.DistilBertModel)(config)
    elif roberta:
        config = tf.XLMRobertaConfig(vocab_size=len(vocab), pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                     type_vocab_size=1, **SHAPE, **extra)
        model = (tf.XLMRobertaForSequenceClassification if labels else tf.XLMRobertaModel)(config)
    else:
        config = tf.BertConfig(vocab_size=len(vocab), pad_token_id=0, **SHAPE, **extra)
        model = (tf.BertForSequenceClassification if labels else tf.BertModel)(config)
    with torch.no_grad():  # layer norms and biases away from their initial ones and zeros: each must count
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0, 0.2)
            elif "token_type" in name or "classifier" in name:  # types that tell, logits away from 0
                p.normal_(0, 0.5)
    model.eval().save_pretrained(path, safe_serialization=True)
    if st_pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"pooling_mode_cls_token": st_pooling == "cls", "pooling_mode_mean_tokens": st_pooling == "mean"}))
    return path


@pytest.fixture(scope="module")
def bert_mean(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("bert_mean"), "bert", 1, st_pooling="mean")


@pytest.fixture(scope="module")
def xlmr(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("xlmr"), "xlm-roberta", 2)


@pytest.fixture(scope="module")
def bert_labels(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("bert3"), "bert", 3, labels=3)


@pytest.fixture(scope="module")
def bert_cross(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("bert_cross"), "bert", 4, labels=1)


@pytest.fixture(scope="module")
def xlmr_cross(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("xlmr_cross"), "xlm-roberta", 5, labels=1)


def _encoded(path: Path, text: str, pair: str | None = None):
    from tokenizers import Tokenizer as Backend

    return Backend.from_file(str(path / "tokenizer.json")).encode(text, pair)


def _inputs(model, path: Path, text: str, pair: str | None) -> dict:
    """transformers' inputs for `text` (and `pair`): the ids, and the token types where the model takes them."""
    enc = _encoded(path, text, pair)
    types = {} if model.config.model_type in ("distilbert", "mpnet", "modernbert") else \
        {"token_type_ids": torch.tensor([enc.type_ids])}
    return {"input_ids": torch.tensor([enc.ids]), **types}


def _hidden(path: Path, text: str, pair: str | None = None) -> torch.Tensor:
    from transformers import AutoModel

    model = cached_model(AutoModel, path)
    with torch.no_grad():
        return model(**_inputs(model, path, text, pair)).last_hidden_state[0]


def _logits(path: Path, text: str, pair: str | None = None) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = cached_model(AutoModelForSequenceClassification, path)
    with torch.no_grad():
        return model(**_inputs(model, path, text, pair)).logits[0]


def _unit(v: torch.Tensor) -> list[float]:
    return torch.nn.functional.normalize(v, dim=-1).tolist()


# ---- what an encoder is served for ----


def test_an_encoder_embeds_by_default_and_classifies_with_a_head(bert_mean, xlmr, bert_labels, xlmr_cross):
    mean = model_config(bert_mean)
    assert mean.tasks == {"embed"} and (mean.pooling.mode, mean.pooling.normalize) == ("mean", True)
    bare = model_config(xlmr)  # no sentence-transformers files: its first token, normalized
    assert bare.tasks == {"embed"} and (bare.pooling.mode, bare.pooling.normalize) == ("cls", True)
    assert not bare.prefix_caching and bare.max_model_len == 64 - 2  # positions past RoBERTa's padding id
    labels = model_config(bert_labels)
    assert labels.tasks == {"classify"} and labels.pooling.mode == "cls" and labels.classifier.num_labels == 3
    assert labels.classifier.dense is not None and labels.tokenizer.typed_pairs  # BERT's: [SEP] b [SEP] type 1
    assert not model_config(xlmr_cross).tokenizer.typed_pairs  # one token type: nothing to mark
    assert model_config(bert_mean, max_num_batched_tokens=16).step_tokens == 64  # an input runs whole


def test_a_sentence_transformers_max_seq_length_is_the_default_model_length(tmp_path, bert_mean):
    """sentence_bert_config.json's max_seq_length (the length the checkpoint was trained to, where
    its library cuts) is the model length unless --max-model-len says otherwise, as vLLM takes it."""
    import shutil

    path = shutil.copytree(bert_mean, tmp_path / "st")
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16, "do_lower_case": False}))
    assert model_config(path).max_model_len == 16 and model_config(path, max_model_len=40).max_model_len == 40
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": "long"}))
    with pytest.raises(ConfigError, match="max_seq_length must be an integer"):
        model_config(path)


def test_a_sentence_transformers_do_lower_case_lowercases_every_text(tmp_path, bert_mean):
    """do_lower_case: sentence-transformers (and vLLM) lowercase a text before a cased tokenizer
    sees it; every route that tokenizes a text does here (embeddings, pairs, /tokenize)."""
    import shutil

    from tokenizers import Tokenizer as Backend
    from tokenizers import normalizers

    path = shutil.copytree(bert_mean, tmp_path / "cased")
    backend = Backend.from_file(str(path / "tokenizer.json"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=False)  # "The" is then unknown
    backend.save(str(path / "tokenizer.json"))
    text = "The Quick Brown FOX"
    assert 1 in backend.encode(text).ids  # [UNK]
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": True}))
    tok = model_config(path).tokenizer
    assert tok.encode(text, True) == backend.encode(text.lower()).ids and 1 not in tok.encode(text, True)
    assert tok.cut("The QUICK brown", 2) == "the quick"
    (path / "sentence_bert_config.json").write_text(json.dumps({"do_lower_case": "yes"}))
    with pytest.raises(ConfigError, match="do_lower_case must be true or false"):
        model_config(path)
    (path / "sentence_bert_config.json").write_text(json.dumps({"do_lower_case": True}))
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        [out] = llm.embed(text)
    assert out.prompt_token_ids == backend.encode(text.lower()).ids
    assert out.outputs.embedding == pytest.approx(_unit(_hidden(bert_mean, text.lower()).mean(0)), abs=2e-5)


@pytest.mark.parametrize("what, engine, refused", [
    ("generate", {"task": "generate"}, "is an encoder: it generates nothing"),
    ("prefix caching", {"enable_prefix_caching": True}, "encoder attends both ways"),
    ("a speculative draft", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "an encoder generates nothing"),
    ("a head from named tokens", {"task": "classify", "hf_overrides": {"classifier_from_token": ["a", "the"]}},
     "an encoder has no LM head"),
    ("a length past its positions", {"max_model_len": 63}, "max_model_len must be in 2..62"),
])
def test_what_an_encoder_cannot_do_is_refused_before_any_rank_starts(xlmr, what, engine, refused):
    with pytest.raises(ConfigError, match=refused):
        model_config(xlmr, **engine)


def test_a_hostile_encoder_config_is_refused_by_field(tmp_path, bert_mean):
    from neuron.engine.model_config import load_config

    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((bert_mean / name).read_bytes())
    base = json.loads((bert_mean / "config.json").read_text())
    for field, value, said in [("layer_norm_eps", float("nan"), "layer_norm_eps must be a finite number"),
                               ("type_vocab_size", 0, "type_vocab_size must be an integer in 1..1024"),
                               ("pad_token_id", 10**9, "pad_token_id must be an integer"),
                               ("intermediate_size", None, "intermediate_size is required"),
                               ("layer_norm_eps", None, r"layer_norm_eps must be a value, or left out \(null"),
                               ("type_vocab_size", None, "type_vocab_size must be a value, or left out"),
                               ("hidden_act", "swish", "hidden_act 'swish' is not supported for an encoder"),
                               ("position_embedding_type", "relative_key", "absolute positions only")]:
        (tmp_path / "config.json").write_text(json.dumps({**base, field: value}))
        with pytest.raises(ConfigError, match=said):
            load_config(tmp_path)


@pytest.mark.parametrize("name, change, said", [
    ("encoder.layer.1.attention.self.query.weight", lambda w: w[:, :32],
     r"has shape \[64, 32\], but the config implies \[64, 64\]"),
    ("embeddings.position_embeddings.weight", lambda w: w[:16],
     r"has shape \[16, 64\], but the config implies \[64, 64\]"),
    ("encoder.layer.0.output.LayerNorm.weight", lambda w: w * float("nan"), "holds NaN or infinite values"),
])
def test_a_hostile_encoder_weight_fails_the_load_by_name(tmp_path, bert_mean, name, change, said):
    from safetensors.torch import load_file, save_file

    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "modules.json"):
        (tmp_path / f).write_bytes((bert_mean / f).read_bytes())
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_bytes((bert_mean / "1_Pooling" / "config.json").read_bytes())
    weights = load_file(bert_mean / "model.safetensors")
    weights[name] = change(weights[name]).contiguous()
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(NeuronError, match=f"tensor {name} {said}"):
        LLM(str(tmp_path), device="cpu", dtype="float32", tensor_parallel_size=2)


# ---- offline: equal to transformers ----


@pytest.mark.parametrize("tp", [1, 2])
def test_bert_embeddings_equal_transformers(bert_mean, tp):
    with LLM(str(bert_mean), device="cpu", dtype="float32", tensor_parallel_size=tp) as llm:
        outs = llm.embed(TEXTS)
        with pytest.raises(NeuronError, match="does not generate|generat"):
            llm.generate("the fox")
    for text, out in zip(TEXTS, outs):
        assert out.prompt_token_ids == _encoded(bert_mean, text).ids
        assert out.outputs.embedding == pytest.approx(_unit(_hidden(bert_mean, text).mean(0)), abs=2e-5)


def test_xlm_roberta_embeddings_at_tp2_equal_transformers(xlmr):
    with LLM(str(xlmr), device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        outs = llm.embed(TEXTS + ["<pad> the <pad> fox"])  # a padding id inside: RoBERTa counts positions past it
        cut = llm.embed(TEXTS[3], PoolingParams(dimensions=16))
    for text, out in zip(TEXTS + ["<pad> the <pad> fox"], outs):
        assert out.outputs.embedding == pytest.approx(_unit(_hidden(xlmr, text)[0]), abs=2e-5)
    assert cut[0].outputs.embedding == pytest.approx(_unit(_hidden(xlmr, TEXTS[3])[0][:16]), abs=2e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_bert_classify_and_cross_encoder_scores_equal_transformers(bert_labels, bert_cross, tp):
    """A BERT cross-encoder scores a pair with the second text as token type 1 (the pair template
    says so), through the pooler and the head, as transformers does (sigmoid of one label)."""
    with LLM(str(bert_labels), device="cpu", dtype="float32", tensor_parallel_size=tp) as llm:
        outs = llm.classify(TEXTS)
    for text, out in zip(TEXTS, outs):
        assert out.outputs.probs == pytest.approx(_logits(bert_labels, text).softmax(-1).tolist(), abs=1e-5)
    with LLM(str(bert_cross), device="cpu", dtype="float32", tensor_parallel_size=tp) as llm:
        scores = llm.score(QUERY, TEXTS)
    for doc, out in zip(TEXTS, scores):
        want = _logits(bert_cross, QUERY, doc)
        assert out.outputs.score == pytest.approx(float(want.sigmoid()), abs=1e-5)
    # the token types count: without them the pair scores otherwise
    assert any(abs(out.outputs.score - float(_typeless(bert_cross, QUERY, doc).sigmoid())) > 1e-4
               for doc, out in zip(TEXTS, scores))


def test_token_types_come_from_the_pair_not_from_a_separator_in_its_text(bert_cross, bert_mean, xlmr):
    """A pair's second text is type 1 from where the pair template starts it: a [SEP] written inside
    the first text, or inside a text embedded alone, leaves what follows it type 0, as transformers'
    tokenizer types it. vLLM's tokens prompt with `token_type_ids` says where offline."""
    first = "the fox [SEP] jumps"
    pair = _encoded(bert_cross, first, TEXTS[1])
    assert pair.ids.count(3) == 3 and pair.type_ids.index(1) > pair.ids.index(3) + 1  # its own [SEP], then the pair's
    with LLM(str(bert_cross), device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        [score] = llm.score(first, TEXTS[1])
        [given] = llm.classify({"prompt_token_ids": pair.ids, "token_type_ids": pair.type_ids})
        [typeless] = llm.classify({"prompt_token_ids": pair.ids})
        mixed = [k % 2 for k in range(len(pair.ids))]
        for types, said in [(pair.type_ids[:-1], "a list of"), (mixed, "zeros, then ones"),
                            ([True] * len(pair.ids), "a list of")]:
            with pytest.raises(ValueError, match=said):
                llm.classify({"prompt_token_ids": pair.ids, "token_type_ids": types})
        with pytest.raises(ValueError, match="would cut a prompt with token_type_ids"):
            llm.classify({"prompt_token_ids": pair.ids, "token_type_ids": pair.type_ids}, truncate_prompt_tokens=4)
        [again] = llm.score(QUERY, TEXTS[0])  # nothing refused was left queued
    want = float(_logits(bert_cross, first, TEXTS[1]).sigmoid())
    assert score.outputs.score == pytest.approx(want, abs=1e-5)
    assert given.outputs.probs[0] == pytest.approx(want, abs=1e-5)
    assert typeless.outputs.probs[0] == pytest.approx(float(_typeless(bert_cross, first, TEXTS[1]).sigmoid()), abs=1e-5)
    assert abs(typeless.outputs.probs[0] - want) > 1e-4
    assert again.outputs.score == pytest.approx(float(_logits(bert_cross, QUERY, TEXTS[0]).sigmoid()), abs=1e-5)
    alone = "hello [SEP] there"
    with LLM(str(bert_mean), device="cpu", dtype="float32") as llm:
        [vector] = llm.embed(alone)
    assert vector.outputs.embedding == pytest.approx(_unit(_hidden(bert_mean, alone).mean(0)), abs=2e-5)
    with LLM(str(xlmr), device="cpu", dtype="float32") as llm:
        with pytest.raises(NeuronError, match="embeds one token type"):
            llm.embed({"prompt_token_ids": [0, 7, 2, 9, 2], "token_type_ids": [0, 0, 0, 1, 1]})


def _typeless(path: Path, text: str, pair: str) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    with torch.no_grad():
        return cached_model(AutoModelForSequenceClassification, path)(
            input_ids=torch.tensor([_encoded(path, text, pair).ids])).logits[0]


def test_distilbert_embeds_and_classifies_at_tp2_equal_to_transformers(tmp_path):
    """DistilBERT: its own config names (dim, n_layers, ...), layer names, no token types, and a
    head of pre_classifier, ReLU and classifier."""
    embedder = _build(tmp_path / "embed", "distilbert", 6, st_pooling="mean")
    classifier = _build(tmp_path / "cls", "distilbert", 7, labels=3)
    assert model_config(embedder).hidden_size == 64 and model_config(classifier).classifier.dense_activation == "relu"
    with LLM(str(embedder), device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        vectors = llm.embed(TEXTS)
    with LLM(str(classifier), device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        probs = llm.classify(TEXTS)
    for text, v, p in zip(TEXTS, vectors, probs):
        assert v.outputs.embedding == pytest.approx(_unit(_hidden(embedder, text).mean(0)), abs=2e-5)
        assert p.outputs.probs == pytest.approx(_logits(classifier, text).softmax(-1).tolist(), abs=1e-5)


def test_an_xlm_roberta_cross_encoder_at_tp2_equals_transformers(xlmr_cross):
    with LLM(str(xlmr_cross), device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        scores = llm.score(QUERY, TEXTS)
    for doc, out in zip(TEXTS, scores):
        assert out.outputs.score == pytest.approx(float(_logits(xlmr_cross, QUERY, doc).sigmoid()), abs=1e-5)


def test_truncate_prompt_tokens_keeps_an_encoders_frame(bert_mean):
    """An encoder's input is cut at its text's end, inside [CLS] ... [SEP], as its tokenizer's
    truncation cuts it (keeping the last tokens would drop the [CLS] it pools or classifies by)."""
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(str(bert_mean / "tokenizer.json"))
    backend.enable_truncation(5)
    cut = backend.encode(TEXTS[3]).ids
    with LLM(str(bert_mean), device="cpu", dtype="float32") as llm:
        [text] = llm.embed(TEXTS[3], truncate_prompt_tokens=5)
        [ids] = llm.embed({"prompt_token_ids": _encoded(bert_mean, TEXTS[3]).ids},
                          PoolingParams(truncate_prompt_tokens=5))
        with pytest.raises(NeuronError, match="leaves no room for the text"):
            llm.embed(TEXTS[3], truncate_prompt_tokens=2)
    assert text.prompt_token_ids == ids.prompt_token_ids == cut and cut[0] == 2 and cut[-1] == 3
    from transformers import AutoModel

    with torch.no_grad():
        hidden = cached_model(AutoModel, bert_mean)(input_ids=torch.tensor([cut])).last_hidden_state[0]
    assert text.outputs.embedding == pytest.approx(_unit(hidden.mean(0)), abs=2e-5)


def test_inputs_run_whole_under_a_small_step_budget_and_a_long_one_is_refused(bert_mean):
    """A step budget below several inputs' lengths: each input still runs whole (never in chunks),
    the rest wait a step; an input past the positions is refused by name, the others unharmed."""
    long = " ".join(["fox"] * 80)
    with LLM(str(bert_mean), device="cpu", dtype="float32", max_num_batched_tokens=8, max_num_seqs=4) as llm:
        outs = llm.embed(TEXTS * 3)
        with pytest.raises(NeuronError, match="64"):
            llm.embed(long)
        again = llm.embed(TEXTS[0])
    for text, out in zip(TEXTS * 3, outs):
        assert out.outputs.embedding == pytest.approx(_unit(_hidden(bert_mean, text).mean(0)), abs=2e-5)
    assert again[0].outputs.embedding == outs[0].outputs.embedding


# ---- served ----


def test_embeddings_and_rerank_are_served_for_encoders(bert_cross, bert_mean):
    with LiveServer(real_engine(str(bert_mean), tp=1, name="embedder")) as server:
        server.wait_ready()
        got = client(server).embeddings.create(model="embedder", input=TEXTS[:2])
        for text, d in zip(TEXTS, got.data):
            assert d.embedding == pytest.approx(_unit(_hidden(bert_mean, text).mean(0)), abs=2e-5)
        r = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"model": "embedder", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "an encoder, it generates nothing" in r.json()["error"]["message"]
        # vLLM's /tokenize: a prompt as the model reads it ([CLS] ... [SEP]: the count embeddings bill)
        counted = httpx.post(f"{server.url}/tokenize", json={"model": "embedder", "prompt": TEXTS[0]}).json()
        billed = client(server).embeddings.create(model="embedder", input=TEXTS[0]).usage.prompt_tokens
        assert counted["tokens"] == _encoded(bert_mean, TEXTS[0]).ids and counted["count"] == billed
        bare = httpx.post(f"{server.url}/tokenize",
                          json={"model": "embedder", "prompt": TEXTS[0], "add_special_tokens": False}).json()
        assert bare["tokens"] == counted["tokens"][1:-1]
    query = "what does the fox [SEP] do"  # its own [SEP] leaves it type 0: the documents are type 1
    with LiveServer(real_engine(str(bert_cross), tp=2, name="ranker")) as server:
        server.wait_ready()
        r = httpx.post(f"{server.url}/rerank", json={"model": "ranker", "query": query, "documents": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
        want = [float(_logits(bert_cross, query, doc).sigmoid()) for doc in TEXTS]
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(len(TEXTS)), key=lambda k: -want[k])
        assert [x["relevance_score"] for x in results] == pytest.approx([want[x["index"]] for x in results], abs=1e-5)


# ---- llama.cpp's `bert` GGUF files ----


def _gguf_weights_model(path: Path, gguf_file: Path):
    """transformers' BertModel of `path` with each weight as gguf dequantizes the file's tensor."""
    import gguf
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, model.config.num_hidden_layers)
    tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_file)).tensors}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("pooler."):
                continue
            t = tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))]
            value = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy())
            p[-value.shape[0]:].copy_(value.reshape(-1, *p.shape[1:]))  # XLM-R's positions: the rows kept
    return model.eval()


@pytest.mark.parametrize("types, tp", [("F32", 2), ("F16", 1), ("Q8_0", 2)])
def test_a_bert_gguf_file_embeds_equal_to_transformers(tmp_path, monkeypatch, bert_mean, types, tp):
    """A BERT embedding model as llama.cpp writes it (Ollama's all-minilm and mxbai-embed-large):
    its metadata read as BERT's config, its WordPiece vocabulary read back from llama.cpp's spelling
    into the checkpoint's own ids, its pooling type; the vectors equal to transformers on the file's
    weights as gguf dequantizes them (Q8_0 on the exact kernel: the integer one rounds activations,
    test_quant_int.py bounds it)."""
    from gguf_files import write_bert_gguf

    monkeypatch.setenv("NEURON_QUANT_EXACT", "1")
    path = write_bert_gguf(bert_mean, tmp_path / "model.gguf", types, pooling=1)
    config = model_config(path)
    tok = config.tokenizer
    for text in [*TEXTS, QUERY, "Ünïcode ACCENTS, [SEP] and [MASK] inside", "foxdog jumped"]:
        assert tok.encode(text, add_special_tokens=True) == _encoded(bert_mean, text).ids, text
    ids, types_from = tok.encode_pair(QUERY, TEXTS[0])
    assert ids == _encoded(bert_mean, QUERY, TEXTS[0]).ids and tok.decode(ids) == f"{QUERY} {TEXTS[0]}"
    assert config.encoder and config.pooling.mode == "mean" and config.hf_config["type_vocab_size"] == 2
    with LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=tp) as llm:
        vectors = llm.embed(TEXTS)
    model = _gguf_weights_model(bert_mean, path)
    for text, v in zip(TEXTS, vectors):
        enc = _encoded(bert_mean, text)
        with torch.no_grad():
            want = model(input_ids=torch.tensor([enc.ids]), token_type_ids=torch.tensor([enc.type_ids]))
        assert v.outputs.embedding == pytest.approx(_unit(want.last_hidden_state[0].mean(0)), abs=2e-5)
    if types == "F32":  # the file's weights are the checkpoint's
        assert vectors[0].outputs.embedding == pytest.approx(_unit(_hidden(bert_mean, TEXTS[0]).mean(0)), abs=2e-5)


def test_llama_servers_embedding_route_and_vllms_use_activation(tmp_path, bert_mean):
    """llama-server's /embedding (and /embeddings) on a BERT GGUF file, as llama.cpp's clients call
    it: `content` a text, ids or a list, each pooled vector scaled by `embd_normalize` as
    llama-server scales it; vLLM's `use_activation` false on /v1/embeddings: the vector as pooled."""
    from gguf_files import write_bert_gguf

    path = write_bert_gguf(bert_mean, tmp_path / "minilm.gguf", "F32", pooling=1)
    raw = [_hidden(bert_mean, t).mean(0).double() for t in TEXTS[:2]]
    scales = {-1: lambda v: v, 0: lambda v: v * 32760 / v.abs().max(), 1: lambda v: v / v.abs().sum(),
              2: lambda v: v / v.norm(), 3: lambda v: v / (v.abs() ** 3).sum() ** (1 / 3)}
    with LiveServer(real_engine(str(path), tp=1, name="minilm")) as server:
        server.wait_ready()
        for norm, scale in scales.items():
            r = httpx.post(f"{server.url}/embedding", json={"content": TEXTS[:2], "embd_normalize": norm})
            assert r.status_code == 200, r.text
            assert [d["index"] for d in r.json()] == [0, 1]
            for d, v in zip(r.json(), raw):
                want = scale(v)
                assert d["embedding"][0] == pytest.approx(want.tolist(), rel=1e-4, abs=1e-4 * float(want.abs().max()))
        ids = _encoded(bert_mean, TEXTS[0]).ids
        by_ids = httpx.post(f"{server.url}/embeddings", json={"input": ids}).json()
        assert len(by_ids) == 1 and by_ids[0]["embedding"][0] == pytest.approx(_unit(raw[0]), abs=2e-5)
        unnormalized = client(server).embeddings.create(model="minilm", input=TEXTS[0],
                                                        extra_body={"use_activation": False})
        assert unnormalized.data[0].embedding == pytest.approx(raw[0].tolist(), abs=1e-4)
        for body, said in [({"content": TEXTS[0], "embd_normalize": "2"}, "Expected `int`, got `str`"),
                           ({"content": TEXTS[0], "embd_normalize": -2}, "embd_normalize must be an integer in -1"),
                           ({"embd_normalize": 2}, '"input" or "content" must be provided'),
                           ({"content": [TEXTS[0], ""]}, "content must be a non-empty text"),
                           ({"content": [[ids[0], "fox"]]}, "content must be a non-empty text"),
                           ({"content": {"a": 1}}, "content must be a non-empty text")]:
            r = httpx.post(f"{server.url}/embedding", json=body)
            assert r.status_code == 400 and said in r.json()["error"]["message"], (body, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert httpx.get(f"{server.url}/health").status_code == 200


def _unigram_xlmr(path: Path, labels: int = 0) -> Path:
    """A tiny random XLM-RoBERTa whose tokenizer is transformers' XLMRobertaTokenizer (sentencepiece
    unigram pieces and scores) over WORDS, as bge-m3 and multilingual-e5 ship theirs; with `labels`,
    its sequence-classification model (a cross-encoder, as bge-reranker-v2-m3)."""
    import transformers as tf

    letters = sorted({c for w in WORDS for c in w})
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + \
        [("\u2581" + w, -1.0 - 0.1 * i) for i, w in enumerate(WORDS)] + [("\u2581", -4.0)] + \
        [(c, -5.0 - 0.01 * i) for i, c in enumerate(letters)] + [("<mask>", 0.0)]
    tf.XLMRobertaTokenizer(vocab=vocab).save_pretrained(path)
    torch.manual_seed(9)
    config = tf.XLMRobertaConfig(vocab_size=len(vocab), pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                 type_vocab_size=1, **SHAPE, **({"num_labels": labels} if labels else {}))
    model = (tf.XLMRobertaForSequenceClassification if labels else tf.XLMRobertaModel)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0, 0.2)
            elif "classifier" in name:  # logits away from 0
                p.normal_(0, 0.5)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("types, tp", [("F32", 2), ("Q8_0", 1)])
def test_an_xlm_roberta_gguf_file_embeds_equal_to_transformers(tmp_path, monkeypatch, types, tp):
    """XLM-RoBERTa as llama.cpp writes it (Ollama's bge-m3): a `bert` file with a `t5` unigram
    vocabulary, read back as transformers' XLMRobertaTokenizer builds it, and its position table,
    which the converter cut past the padding id, read back; [CLS] pooling as its metadata says."""
    from gguf_files import write_bert_gguf

    monkeypatch.setenv("NEURON_QUANT_EXACT", "1")
    src = _unigram_xlmr(tmp_path / "hf")
    path = write_bert_gguf(src, tmp_path / "bge.gguf", types, pooling=2)
    config = model_config(path)
    assert config.hf_config["model_type"] == "xlm-roberta" and config.max_model_len == 64 - 2
    assert config.pooling.mode == "cls" and not config.tokenizer.typed_pairs
    tok = config.tokenizer
    for text in [*TEXTS, QUERY, "  the   lazy\tdog  ", "unknown-ish Ünïcode", "<mask> and </s> inside"]:
        assert tok.encode(text, add_special_tokens=True) == _encoded(src, text).ids, text
    assert tok.encode_pair(QUERY, TEXTS[0])[0] == _encoded(src, QUERY, TEXTS[0]).ids
    assert tok.decode(tok.encode(TEXTS[3])) == TEXTS[3]
    with LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=tp) as llm:
        vectors = llm.embed(TEXTS)
    model = _gguf_weights_model(src, path)
    for text, v in zip(TEXTS, vectors):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([_encoded(src, text).ids])).last_hidden_state[0, 0]
        assert v.outputs.embedding == pytest.approx(_unit(want), abs=2e-5)


def test_a_gguf_cross_encoder_scores_as_its_head_says(tmp_path, monkeypatch):
    """Cross-encoders as llama.cpp's converter writes them (bge-reranker-v2-m3, ms-marco's MiniLM):
    XLM-RoBERTa's head as `cls` and `cls.output`, rank pooling, served for scores equal to
    transformers at tp 2; BERT's classifier as `cls.output` without its pooler, which the converter
    leaves out (llama.cpp scores the file without it, and so does neuron), with the labels' names
    the file gives."""
    from gguf_files import write_bert_gguf

    src = _unigram_xlmr(tmp_path / "xlmr", labels=1)
    path = write_bert_gguf(src, tmp_path / "reranker.gguf", "F32", pooling=4)
    config = model_config(path)
    assert config.hf_config["architectures"] == ["XLMRobertaForSequenceClassification"]
    assert config.pooling.classifier is not None and config.pooling.classifier.dense is not None
    with LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        scores = llm.score(QUERY, TEXTS)
    for doc, out in zip(TEXTS, scores):
        assert out.outputs.score == pytest.approx(float(_logits(src, QUERY, doc).sigmoid()), abs=2e-5)

    bert = _build(tmp_path / "bert", "bert", 6, labels=3)
    hf = json.loads((bert / "config.json").read_text())
    (bert / "config.json").write_text(json.dumps({**hf, "id2label": {"0": "neg", "1": "mixed", "2": "pos"}}))
    path = write_bert_gguf(bert, tmp_path / "labels.gguf", "F32")
    head = model_config(path).pooling.classifier
    assert head.labels == ("neg", "mixed", "pos") and head.dense is None
    from transformers import AutoModelForSequenceClassification

    classifier = cached_model(AutoModelForSequenceClassification, bert).classifier
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        outs = llm.classify(TEXTS)
    for text, out in zip(TEXTS, outs):
        with torch.no_grad():
            want = classifier(_hidden(bert, text)[0]).softmax(-1)  # [CLS] straight into the classifier
        assert out.outputs.probs == pytest.approx(want.tolist(), abs=2e-5)
        assert out.outputs.probs != pytest.approx(_logits(bert, text).softmax(-1).tolist(), abs=1e-3)  # the pooler's
    import gguf  # labels that do not name each row of the head: refused by name

    monkeypatch.setattr(gguf.GGUFWriter, "add_classifier_output_labels",
                        lambda w, labels: w.add_array(f"{w.arch}.classifier.output_labels", [*labels, "extra"]))
    (tmp_path / "extra").mkdir()
    extra = write_bert_gguf(bert, tmp_path / "extra" / "labels.gguf", "F32")
    with pytest.raises(ConfigError, match="bert.classifier.output_labels must name each of the 3 rows"):
        model_config(extra)


def test_what_a_bert_gguf_file_cannot_be_is_refused_by_name(tmp_path, bert_mean):
    from gguf_files import write_bert_gguf

    roberta = write_bert_gguf(bert_mean, tmp_path / "xlmr.gguf", vocabulary="gpt2")
    with pytest.raises(ConfigError, match="a GGUF `bert` file with a 'gpt2' vocabulary .* is not read"):
        model_config(roberta)
    (tmp_path / "rank").mkdir()
    ranker = write_bert_gguf(bert_mean, tmp_path / "rank" / "ranker.gguf", pooling=4)
    with pytest.raises(ConfigError, match="pooling type 4 is not supported"):
        model_config(ranker)
    (tmp_path / "bytes").mkdir()  # a metadata string that is not UTF-8
    data = bytearray((tmp_path / "xlmr.gguf").read_bytes())
    at = data.index(b"tokenizer.ggml.model") + len(b"tokenizer.ggml.model") + 4 + 8  # past its type and length
    data[at] = 0xFF
    (tmp_path / "bytes" / "bytes.gguf").write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="tokenizer.ggml.model is a string that is not UTF-8"):
        model_config(tmp_path / "bytes" / "bytes.gguf")
    (tmp_path / "twice").mkdir()  # two tokens that read back as one piece: `▁fox` and a second `▁fox`
    twice = write_bert_gguf(bert_mean, tmp_path / "twice" / "twice.gguf", spelled={6: "\u2581fox"})
    with pytest.raises(NeuronError, match=r"token 8 \('▁fox'\) reads back as 'fox', as token 6 does"):
        model_config(twice)


def test_a_tokenizer_files_truncation_and_padding_are_not_applied(tmp_path, bert_mean):
    """sentence-transformers' BERT tokenizer.json files carry truncation and padding (128): a prompt
    is neither cut nor padded by them (its length is checked, and cut by the request's own rules)."""
    from tokenizers import Tokenizer as Backend

    from neuron.engine.tokenizer import Tokenizer

    backend = Backend.from_file(str(bert_mean / "tokenizer.json"))
    backend.enable_truncation(4)
    backend.enable_padding(length=16, pad_id=0, pad_token="[PAD]")
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text((bert_mean / "tokenizer_config.json").read_text())
    text = TEXTS[3]
    assert len(backend.encode(text).ids) == 16  # what the file alone would make of it
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode(text, add_special_tokens=True) == _encoded(bert_mean, text).ids
    assert tok.join_pair(tok.encode(QUERY), tok.encode(text))[0] == _encoded(bert_mean, QUERY, text).ids


def test_an_encoder_beside_a_chat_model_in_one_host(tmp_path, bert_mean):
    """A model host serving a decoder for chat and an encoder for embeddings at once: each answers
    its own routes (OpenAI's and Ollama's), the encoder's ranks hold no KV cache, and a chat to the
    encoder is a 400 that leaves both serving."""
    from checkpoints import build_checkpoint

    from neuron.engine.engine_config import EngineConfig
    from neuron.engine.host import ModelHost, ModelSpec

    defaults = EngineConfig(device="cpu", dtype="float32", max_num_seqs=4)
    chat = build_checkpoint(tmp_path / "chat", seed=3)
    host = ModelHost([ModelSpec.parse({"name": "chat", "model": str(chat), "max_model_len": 128}, defaults, "t"),
                      ModelSpec.parse({"name": "embed", "model": str(bert_mean), "tp": 2}, defaults, "t")],
                    defaults=defaults)
    want = [_unit(_hidden(bert_mean, text).mean(0)) for text in TEXTS[:2]]
    with LiveServer(host) as server:
        server.wait_ready()
        got = client(server).embeddings.create(model="embed", input=TEXTS[:2]).data
        assert [d.embedding for d in got] == [pytest.approx(w, abs=2e-5) for w in want]
        ollama = httpx.post(f"{server.url}/api/embed", json={"model": "embed", "input": TEXTS[:2]}).json()
        assert ollama["embeddings"] == [pytest.approx(w, abs=2e-5) for w in want]
        r = httpx.post(f"{server.base_url}/chat/completions",
                       json={"model": "embed", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_generative"
        done = client(server).completions.create(model="chat", prompt=[5, 6, 7], max_tokens=4, temperature=0)
        assert done.choices[0].finish_reason in ("length", "stop")
        memory = httpx.get(f"{server.url}/health").json()["models"]["embed"]["memory"]
        assert len(memory) == 2 and all(r["kv_bytes"] == 0 and r["weight_bytes"] > 0 for r in memory)


def _modernbert(path: Path, seed: int, labels: int = 0, **extra) -> Path:
    """A tiny random ModernBERT (three layers: one global, two local with a window of 4 positions
    either way, so that the inputs here reach past it) with the WordPiece tokenizer above."""
    import transformers as tf

    path.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(path, roberta=False)
    torch.manual_seed(seed)
    config = tf.ModernBertConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                 num_attention_heads=4, max_position_embeddings=64, local_attention=8,
                                 pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3,
                                 **({"num_labels": labels} if labels else {}), **extra)
    model = (tf.ModernBertForSequenceClassification if labels else tf.ModernBertModel)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0, 0.2)
            elif name.endswith("bias") or "classifier" in name or "head" in name:
                p.normal_(0, 0.5)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


LONG = "the quick brown fox jumps over the lazy dog, and what does the cat do on the mat today?"


@pytest.mark.parametrize("tp", [1, 2])
def test_modernbert_embeds_and_classifies_equal_to_transformers(tmp_path, tp):
    """ModernBERT: global and local (windowed) layers with their own rotary bases, the gated MLP and
    its head (dense, GELU, norm) over the first token or the mean, with and without biases."""
    embedder = _modernbert(tmp_path / "embed", 8)
    first = _modernbert(tmp_path / "cls", 9, labels=3, classifier_bias=True)
    mean = _modernbert(tmp_path / "mean", 10, labels=1, classifier_pooling="mean", norm_bias=True,
                       attention_bias=True, mlp_bias=True)
    texts = TEXTS + [LONG]
    assert len(_encoded(embedder, LONG).ids) > 2 * 4 + 1  # past a local layer's window
    assert model_config(embedder).pooling.mode == "cls" and model_config(mean).pooling.mode == "mean"
    with LLM(str(embedder), device="cpu", dtype="float32", tensor_parallel_size=tp) as llm:
        vectors = llm.embed(texts)
    for text, v in zip(texts, vectors):
        assert v.outputs.embedding == pytest.approx(_unit(_hidden(embedder, text)[0]), abs=2e-5)
    for path in (first, mean):
        with LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=tp) as llm:
            probs = llm.classify(texts)
        for text, p in zip(texts, probs):
            logits = _logits(path, text)
            want = logits.softmax(-1) if len(logits) > 1 else logits.sigmoid()
            assert p.outputs.probs == pytest.approx(want.tolist(), abs=1e-5), path.name


def _mpnet(path: Path, seed: int, labels: int = 0) -> Path:
    """A tiny random MPNet (the relative-position bias table over 32 buckets, positions past the
    padding id 1) with RoBERTa's kind of tokenizer (<s> a </s></s> b </s>), as all-mpnet ships."""
    import transformers as tf

    path.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(path, roberta=True)
    torch.manual_seed(seed)
    config = tf.MPNetConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=200, pad_token_id=1, bos_token_id=0,
                            eos_token_id=2, **({"num_labels": labels} if labels else {}))
    model = (tf.MPNetForSequenceClassification if labels else tf.MPNetModel)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0, 0.2)
            elif "relative_attention_bias" in name or "classifier" in name or name.endswith("bias"):
                p.normal_(0, 0.5)  # a bias per bucket that moves the scores
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("tp", [1, 2])
def test_mpnet_embeds_and_scores_equal_to_transformers(tmp_path, tp):
    """MPNet (all-mpnet-base-v2's architecture): every layer's scores biased by a learned value per
    head and relative-position bucket, exact near the query and logarithmic out to 128 positions
    (an input of 150 tokens reaches the last bucket)."""
    embedder = _mpnet(tmp_path / "embed", 11)
    cross = _mpnet(tmp_path / "cross", 12, labels=1)
    long = " ".join(WORDS * 6)
    assert 128 < len(_encoded(embedder, long).ids) <= 198
    texts = TEXTS + [long]
    with LLM(str(embedder), device="cpu", dtype="float32", tensor_parallel_size=tp) as llm:
        vectors = llm.embed(texts)
    for text, v in zip(texts, vectors):
        assert v.outputs.embedding == pytest.approx(_unit(_hidden(embedder, text)[0]), abs=2e-5)
    with LLM(str(cross), device="cpu", dtype="float32", tensor_parallel_size=tp) as llm:
        scores = llm.score(QUERY, texts)
    for doc, out in zip(texts, scores):
        assert out.outputs.score == pytest.approx(float(_logits(cross, QUERY, doc).sigmoid()), abs=1e-5)


# ---- on a GPU (skipped, with the reason, where there is none) ----


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_encoders_on_cuda_equal_transformers(tmp_path, bert_cross, tp):
    """The families' CUDA path (PyTorch's attention with MPNet's bias and ModernBERT's window on
    the GPU; tp 2 is two ranks on one device): embeddings and cross-encoder scores as on CPU."""
    cases = [(_mpnet(tmp_path / "mpnet", 13), TEXTS + [" ".join(WORDS * 5)]),  # past MPNet's last bucket
             (_modernbert(tmp_path / "modernbert", 14), TEXTS + [LONG])]  # past ModernBERT's window
    for path, texts in cases:
        with LLM(str(path), device="cuda", dtype="float32", tensor_parallel_size=tp) as llm:
            vectors = llm.embed(texts)
        for text, v in zip(texts, vectors):
            assert v.outputs.embedding == pytest.approx(_unit(_hidden(path, text)[0]), abs=1e-4), path.name
    with LLM(str(bert_cross), device="cuda", dtype="float32", tensor_parallel_size=tp) as llm:
        scores = llm.score(QUERY, TEXTS)
    for doc, out in zip(TEXTS, scores):
        assert out.outputs.score == pytest.approx(float(_logits(bert_cross, QUERY, doc).sigmoid()), abs=1e-4)


@pytest.mark.parametrize("change, said", [
    (dict(scores=[0.0]), "one finite tokenizer.ggml.scores entry per token"),
    (dict(scores=[0.0, float("nan"), 0.0, 0.0]), "one finite tokenizer.ggml.scores entry per token"),
    (dict(tokens=["<s>", "<s>", "</s>", "<unk>"]), "holds a token twice"),
    (dict(kinds=[3, 3, 3, 3]), "needs one unknown token, it has 0"),
    (dict(ids={"bos_token": ("tokenizer.ggml.bos_token_id", 10**9)}), "bos_token_id must be a token id below 4"),
    (dict(ids={}), "needs its bos_token, eos_token's id"),
    (dict(charsmap=[1, 2, 3]), "is not a character map"),
    (dict(charsmap=[300]), "must hold bytes"),
    (dict(space_prefix="yes"), "add_space_prefix must be true or false"),
    (dict(kinds=[3]), "one tokenizer.ggml.token_type per token"),
])
def test_a_hostile_unigram_vocabulary_is_refused_by_what_is_wrong(change, said):
    """A GGUF file's XLM-RoBERTa vocabulary, each of its parts wrong in turn."""
    from dataclasses import replace

    from neuron.engine.gguf_vocab import GGUFVocabulary, VocabularyError, vocabulary_tokenizer

    ids = {"bos_token": ("tokenizer.ggml.bos_token_id", 0), "eos_token": ("tokenizer.ggml.eos_token_id", 2)}
    good = GGUFVocabulary("t5", ["<s>", "<pad>", "</s>", "<unk>"], [3, 3, 3, 2], ids, scores=[0.0, 0.0, 0.0, 0.0])
    vocabulary_tokenizer(good)
    with pytest.raises(VocabularyError, match=said):
        vocabulary_tokenizer(replace(good, **change))
