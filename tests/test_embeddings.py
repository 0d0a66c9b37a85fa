"""Embeddings: pooling models recognised from their sentence-transformers files, pooled on rank 0 in
the ordinary batched step, equal to transformers' last hidden state pooled the same way (tp 1 and
2, chunked prefill, cached prefixes), and `/v1/embeddings` through the official `openai` client,
with what it refuses."""

from __future__ import annotations

import base64
import json
import shutil
import struct

import httpx
import ollama
import openai
import pytest
import torch
from checkpoints import build_checkpoint, build_embedding_checkpoint, model_config, reference_embeddings
from server_harness import LiveServer, client, metric, ollama_client, real_engine, wait_until

from neuron import LLM, PoolingParams, SamplingParams
from neuron.engine.host import HostError, ModelSpec
from neuron.engine.input_processor import RequestError
from neuron.engine.model_config import sentence_transformers_pooling
from neuron.engine.pooling import PoolingConfig
from neuron.entrypoints import serve
from neuron.entrypoints.cli import _parser
from neuron.errors import ConfigError, NeuronError

# prompts of different lengths: one token, a few, several 16-token prefill chunks (small_prefill_chunks)
PROMPTS = [[5], [1, 2, 3, 4, 5, 6, 7], [(7 * i + 3) % 250 for i in range(53)], [9, 8, 7, 6] * 10]


def _close(got: list[float], want: torch.Tensor, atol: float = 1e-5) -> None:
    """Equal to the reference within `atol` per value, and a cosine of at least 0.99999."""
    v = torch.tensor(got)
    assert v.shape == want.shape
    assert torch.allclose(v, want, atol=atol), (v - want).abs().max()
    assert torch.nn.functional.cosine_similarity(v, want, dim=0) >= 0.99999


@pytest.fixture(scope="module")
def last_token_checkpoint(tmp_path_factory):
    """Qwen3-Embedding's layout with the embedded default model's tokenizer (so text inputs work)."""
    from neuron.engine.tokenizer import Tokenizer
    from neuron.utils.default_checkpoint import default_model_dir

    tokenizer_dir = default_model_dir()
    vocab = Tokenizer.from_dir(tokenizer_dir).vocab_size
    path = build_embedding_checkpoint(tmp_path_factory.mktemp("embed-last"), seed=3, vocab_size=vocab)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def generation_checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("embed-gen"), seed=4)


# ---- what a checkpoint is served for ----


def _pooling_files(tmp_path, pooling: dict, modules: list[str]):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": i, "path": "1_Pooling" if t == "Pooling" else "", "type": f"sentence_transformers.models.{t}"}
         for i, t in enumerate(modules)]))
    return sentence_transformers_pooling(tmp_path)


@pytest.mark.parametrize("flag, modules, expected", [
    ("pooling_mode_lasttoken", ["Transformer", "Pooling", "Normalize"], PoolingConfig("lasttoken", True)),
    ("pooling_mode_mean_tokens", ["Transformer", "Pooling"], PoolingConfig("mean", False)),
    ("pooling_mode_cls_token", ["Transformer", "Pooling", "Normalize"], PoolingConfig("cls", True)),
])
def test_the_pooling_modes_sentence_transformers_declares_are_read(tmp_path, flag, modules, expected):
    assert _pooling_files(tmp_path, {flag: True, "include_prompt": True}, modules) == expected


@pytest.mark.parametrize("pooling, modules, refused", [
    ({"pooling_mode_max_tokens": True}, ["Transformer", "Pooling"], "pooling_mode_max_tokens is not supported"),
    ({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": True}, ["Transformer", "Pooling"],
     "exactly one of"),
    ({"pooling_mode_lasttoken": True}, ["Transformer", "Pooling", "Dense"], "models.Dense' is not supported"),
    ({"pooling_mode_mean_tokens": True, "include_prompt": False}, ["Transformer", "Pooling"], "include_prompt"),
])
def test_pooling_neuron_cannot_reproduce_is_refused_by_name(tmp_path, pooling, modules, refused):
    with pytest.raises(ConfigError, match=refused):
        _pooling_files(tmp_path, pooling, modules)


def test_the_task_follows_the_checkpoint_unless_set(last_token_checkpoint, generation_checkpoint):
    embed = model_config(last_token_checkpoint)
    assert (embed.tasks, embed.pooling) == ({"embed"}, PoolingConfig("lasttoken", True))
    plain = model_config(generation_checkpoint)
    assert (plain.tasks, plain.pooling) == ({"generate"}, None)
    # a causal LM served for embeddings pools its last token, normalized, as Qwen3-Embedding does
    both = model_config(generation_checkpoint, task="generate,embed")
    assert (both.tasks, both.pooling) == ({"generate", "embed"}, PoolingConfig("lasttoken", True))
    with pytest.raises(ConfigError, match="task must be one of auto, generate, embed, generate,embed, classify"):
        model_config(generation_checkpoint, task="embed,classify")


@pytest.mark.parametrize("kind, mode", [(1, "mean"), (3, "lasttoken")])
def test_a_gguf_embedding_model_pools_as_its_metadata_says(generation_checkpoint, tmp_path, kind, mode):
    """llama.cpp's `{arch}.pooling_type` makes a GGUF file an embedding model, normalized as its
    server and Ollama return vectors; rank pooling (a converted reranker's head) is refused."""
    from gguf_files import write_gguf

    path = write_gguf(generation_checkpoint, tmp_path / "embed.gguf", "F32", tokenizer=False, pooling=kind)
    cfg = model_config(path)
    assert (cfg.tasks, cfg.pooling) == ({"embed"}, PoolingConfig(mode, True))
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        [out] = llm.embed({"prompt_token_ids": PROMPTS[2]})
    _close(out.outputs.embedding, reference_embeddings(generation_checkpoint, PROMPTS[2:3], mode)[0])
    rank = write_gguf(generation_checkpoint, tmp_path / "rank.gguf", "F32", tokenizer=False, pooling=4)
    with pytest.raises(ConfigError, match="GGUF pooling type 4 is not supported"):
        model_config(rank)
    odd = write_gguf(generation_checkpoint, tmp_path / "odd.gguf", "F32", tokenizer=False, pooling="mean")
    with pytest.raises(ConfigError, match=r"qwen3.pooling_type must be an integer .*, got 'mean'"):
        model_config(odd)


def test_serve_and_a_models_file_take_the_task():
    engine, _ = serve.configs(_parser().parse_args(["serve", "some-model", "--task", "generate,embed"]))
    assert engine.task == "generate,embed"
    spec = ModelSpec.parse({"name": "e", "model": "some-model", "task": "embed"}, engine, "entry 1")
    assert spec.engine.task == "embed"
    with pytest.raises(HostError, match="task must be one of auto, generate, embed, generate,embed"):
        ModelSpec.parse({"name": "e", "model": "some-model", "task": "rerank"}, engine, "entry 1")


# ---- parity with transformers ----


@pytest.fixture(scope="module")
def last_token_llm(last_token_checkpoint):
    with LLM(str(last_token_checkpoint), device="cpu", dtype="float32") as llm:
        yield llm


def test_single_and_batched_embeddings_equal_transformers(last_token_llm, last_token_checkpoint):
    want = reference_embeddings(last_token_checkpoint, PROMPTS)
    alone = last_token_llm.embed({"prompt_token_ids": PROMPTS[2]})
    _close(alone[0].outputs.embedding, want[2])
    batched = last_token_llm.embed([{"prompt_token_ids": p} for p in PROMPTS])
    assert [o.prompt_token_ids for o in batched] == PROMPTS
    for out, ref in zip(batched, want):
        _close(out.outputs.embedding, ref)


def test_embed_takes_truncate_prompt_tokens(last_token_llm, last_token_checkpoint):
    [cut] = last_token_llm.embed({"prompt_token_ids": PROMPTS[2]}, truncate_prompt_tokens=9)
    assert cut.prompt_token_ids == PROMPTS[2][-9:]
    _close(cut.outputs.embedding, reference_embeddings(last_token_checkpoint, [PROMPTS[2][-9:]])[0])
    [same] = last_token_llm.embed({"prompt_token_ids": PROMPTS[2]}, PoolingParams(truncate_prompt_tokens=9))
    assert same.outputs.embedding == cut.outputs.embedding


def test_score_is_the_cosine_of_the_embeddings(last_token_llm, last_token_checkpoint):
    ref = reference_embeddings(last_token_checkpoint, PROMPTS[:3])
    cos = [[float(torch.dot(a, b) / (a.norm() * b.norm())) for b in ref] for a in ref]
    one = last_token_llm.score({"prompt_token_ids": PROMPTS[0]}, [{"prompt_token_ids": p} for p in PROMPTS[:3]])
    assert [o.outputs.score for o in one] == pytest.approx(cos[0], abs=1e-4)
    assert one[2].prompt_token_ids == PROMPTS[0] + PROMPTS[2]
    pairs = last_token_llm.score([{"prompt_token_ids": p} for p in PROMPTS[1:3]],
                                 [{"prompt_token_ids": p} for p in PROMPTS[:2]])
    assert [o.outputs.score for o in pairs] == pytest.approx([cos[1][0], cos[2][1]], abs=1e-4)
    with pytest.raises(ValueError, match="data_1 has 2 prompts and data_2 3"):
        last_token_llm.score([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                             [{"prompt_token_ids": p} for p in PROMPTS[:3]])


def test_async_encode_gives_the_embedding(last_token_checkpoint):
    import asyncio

    from neuron import AsyncLLM

    async def main():
        async with AsyncLLM(str(last_token_checkpoint), device="cpu", dtype="float32") as llm:
            return [o async for o in llm.encode({"prompt_token_ids": PROMPTS[2]}, PoolingParams(dimensions=8))]

    [out] = asyncio.run(main())
    want = reference_embeddings(last_token_checkpoint, PROMPTS[2:3], normalize=False)[0][:8]
    _close(out.outputs.data.tolist(), torch.nn.functional.normalize(want, dim=0))


def test_a_generation_model_does_not_encode(generation_checkpoint):
    import asyncio

    from neuron import AsyncLLM

    async def main():
        async with AsyncLLM(str(generation_checkpoint), device="cpu", dtype="float32") as llm:
            return [o async for o in llm.encode({"prompt_token_ids": [1, 2]})]

    with pytest.raises(NeuronError, match="this model pools nothing"):
        asyncio.run(main())


def test_a_cached_prefix_still_gives_the_right_vector(last_token_llm, last_token_checkpoint):
    engine = last_token_llm.engine
    prefix = [(11 * i + 1) % 250 for i in range(48)]  # three full 16-token blocks
    longer = prefix + [3, 1, 4, 1, 5]
    want = reference_embeddings(last_token_checkpoint, [prefix, longer])
    _close(last_token_llm.embed({"prompt_token_ids": prefix})[0].outputs.embedding, want[0])
    _, hits = engine.prefix_cache_counts()
    _close(last_token_llm.embed({"prompt_token_ids": longer})[0].outputs.embedding, want[1])
    assert engine.prefix_cache_counts()[1] - hits == 48  # its prefix came from the cache, not a new prefill
    again = engine.prefix_cache_counts()[1]
    _close(last_token_llm.embed({"prompt_token_ids": prefix})[0].outputs.embedding, want[0])
    assert engine.prefix_cache_counts()[1] - again == 32  # the last block is recomputed for its last token


@pytest.mark.parametrize("mode, normalize", [("mean", False), ("cls", True)])
def test_mean_and_first_token_pooling_equal_transformers_across_chunks(tmp_path, small_prefill_chunks, mode,
                                                                      normalize):
    path = build_embedding_checkpoint(tmp_path, seed=5, pooling=mode, normalize=normalize)
    want = reference_embeddings(path, PROMPTS + PROMPTS[2:3], mode, normalize)
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        first = llm.embed([{"prompt_token_ids": p} for p in PROMPTS])
        # the same long prompt again: every row is wanted, so no cached prefix may stand in for them
        again = llm.embed({"prompt_token_ids": PROMPTS[2]})
        assert llm.engine.prefix_cache_counts()[1] == 0
    for out, ref in zip(first + again, want):
        _close(out.outputs.embedding, ref, atol=1e-5 if normalize else 1e-4)


def test_dimensions_truncate_then_normalize(last_token_llm, last_token_checkpoint):
    full = reference_embeddings(last_token_checkpoint, [PROMPTS[1]], normalize=False)[0]
    out = last_token_llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(dimensions=16))[0]
    _close(out.outputs.embedding, torch.nn.functional.normalize(full[:16], dim=0))
    with pytest.raises(RequestError, match="dimensions must be in 1..64"):
        last_token_llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(dimensions=65))


def test_an_embedding_model_refuses_generation_offline(last_token_llm):
    with pytest.raises(RequestError, match="is an embedding model.*--task generate,embed"):
        last_token_llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))


def test_pooling_and_generation_share_a_step(generation_checkpoint):
    """--task generate,embed: an embedding and a generation run in one batched step, and each is
    what it would be alone."""
    from checkpoints import reference_greedy

    prompt = PROMPTS[1]
    want_vector = reference_embeddings(generation_checkpoint, [PROMPTS[3]])[0]
    want_tokens, _ = reference_greedy(generation_checkpoint, prompt, 3)
    with LLM(str(generation_checkpoint), task="generate,embed", device="cpu", dtype="float32") as llm:
        engine = llm.engine
        engine.add_request("gen", prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        engine.add_request("emb", PROMPTS[3], PoolingParams())
        first = {u.request_id: u for u in engine.step()}
        assert first["gen"].token_ids == want_tokens[:1] and not first["gen"].finished
        assert first["emb"].finished and first["emb"].embedding is not None
        _close(first["emb"].embedding, want_vector)
        tokens = list(first["gen"].token_ids)
        while engine.has_unfinished():
            tokens += [t for u in engine.step() for t in u.token_ids]
    assert tokens == want_tokens


def test_a_generation_model_does_not_embed(generation_checkpoint):
    with LLM(str(generation_checkpoint), device="cpu", dtype="float32") as llm:
        with pytest.raises(NeuronError, match="does not embed"):
            llm.embed("hello")
        with pytest.raises(RequestError, match="is a generation model"):
            llm.engine.add_request("x", [1, 2, 3], PoolingParams())


@pytest.mark.slow
def test_embeddings_equal_transformers_at_tp2(last_token_checkpoint, small_prefill_chunks):
    want = reference_embeddings(last_token_checkpoint, PROMPTS)
    with LLM(str(last_token_checkpoint), tensor_parallel_size=2, device="cpu", dtype="float32") as llm:
        outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS])
    for out, ref in zip(outs, want):
        _close(out.outputs.embedding, ref)


# ---- /v1/embeddings through the openai client, at tp 2 ----

TEXTS = ["The quick brown fox", "jumps over the lazy dog, again and again, until it tires", "x"]


@pytest.fixture(scope="module")
def embed_server(last_token_checkpoint):
    engine = real_engine(str(last_token_checkpoint), tp=2, name="embedder", max_model_len=256)
    with LiveServer(engine) as server:
        yield server.wait_ready()


@pytest.fixture(scope="module")
def text_ids(last_token_checkpoint):
    from neuron.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(last_token_checkpoint)
    return [tok.encode(t, add_special_tokens=True) for t in TEXTS]


def test_float_embeddings_of_text_equal_transformers(embed_server, last_token_checkpoint, text_ids):
    resp = client(embed_server).embeddings.create(model="embedder", input=TEXTS, encoding_format="float")
    want = reference_embeddings(last_token_checkpoint, text_ids)
    assert [d.index for d in resp.data] == [0, 1, 2] and resp.model == "embedder"
    for d, ref in zip(resp.data, want):
        _close(d.embedding, ref)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(map(len, text_ids))


def test_base64_is_little_endian_float32_of_the_same_vectors(embed_server):
    c = client(embed_server)
    floats = c.embeddings.create(model="embedder", input=TEXTS[:2], encoding_format="float").data
    raw = c.embeddings.create(model="embedder", input=TEXTS[:2], encoding_format="base64").data
    default = c.embeddings.create(model="embedder", input=TEXTS[:2]).data  # the client asks for base64, decodes
    for f, r, d in zip(floats, raw, default):
        decoded = list(struct.unpack(f"<{len(f.embedding)}f", base64.b64decode(r.embedding)))
        assert decoded == pytest.approx(f.embedding, abs=0) and d.embedding == pytest.approx(f.embedding, abs=0)


def test_token_id_inputs_and_dimensions(embed_server, last_token_checkpoint):
    c = client(embed_server)
    want = reference_embeddings(last_token_checkpoint, PROMPTS)
    one = c.embeddings.create(model="embedder", input=PROMPTS[2], encoding_format="float")
    _close(one.data[0].embedding, want[2])
    several = c.embeddings.create(model="embedder", input=PROMPTS, encoding_format="float")
    for d, ref in zip(several.data, want):
        _close(d.embedding, ref)
    assert several.usage.prompt_tokens == sum(map(len, PROMPTS))
    full = reference_embeddings(last_token_checkpoint, PROMPTS[:2], normalize=False)
    cut = c.embeddings.create(model="embedder", input=PROMPTS[:2], dimensions=8, encoding_format="float")
    for d, ref in zip(cut.data, full):
        assert len(d.embedding) == 8
        _close(d.embedding, torch.nn.functional.normalize(ref[:8], dim=0))


def test_truncate_prompt_tokens_embeds_each_inputs_last_tokens(embed_server, last_token_checkpoint):
    """vLLM's truncate_prompt_tokens: an input longer than the context is embedded by its last tokens."""
    c = client(embed_server)
    long = [(5 * i + 1) % 250 for i in range(300)]  # more than the server's 256
    want = reference_embeddings(last_token_checkpoint, [long[-40:], PROMPTS[1]])
    out = c.embeddings.create(model="embedder", input=[long, PROMPTS[1]], encoding_format="float",
                              extra_body={"truncate_prompt_tokens": 40})
    for d, ref in zip(out.data, want):
        _close(d.embedding, ref)
    assert out.usage.prompt_tokens == 40 + len(PROMPTS[1])
    whole = c.embeddings.create(model="embedder", input=long, encoding_format="float",
                                extra_body={"truncate_prompt_tokens": -1})  # as much as the context holds
    _close(whole.data[0].embedding, reference_embeddings(last_token_checkpoint, [long[-256:]])[0])
    _refused(lambda: c.embeddings.create(model="embedder", input="x", extra_body={"truncate_prompt_tokens": 0}),
             400, "truncate_prompt_tokens", "truncate_prompt_tokens must be -1, an integer >= 1, or null")
    _refused(lambda: c.embeddings.create(model="embedder", input="x", extra_body={"truncate_prompt_tokens": 257}),
             400, "truncate_prompt_tokens", "greater than this model's context (256 tokens)")


def test_ollamas_embed_routes(embed_server, last_token_checkpoint, text_ids):
    """Ollama's /api/embed (L2-normalized vectors; an input past the context cut from its end, as
    Ollama's truncate does, or refused without it) and the older /api/embeddings (the model's vector)."""
    c = ollama_client(embed_server)
    out = c.embed("embedder", TEXTS)
    for got, ref in zip(out.embeddings, reference_embeddings(last_token_checkpoint, text_ids)):
        _close(got, torch.nn.functional.normalize(ref, dim=0))
    assert out.prompt_eval_count == sum(map(len, text_ids)) and out.total_duration > 0
    long = " ".join(["river"] * 400)
    from neuron.engine.tokenizer import Tokenizer

    head = Tokenizer.from_dir(last_token_checkpoint).encode(long, add_special_tokens=True)[:256]
    cut = c.embed("embedder", long)
    _close(cut.embeddings[0], torch.nn.functional.normalize(reference_embeddings(last_token_checkpoint,
                                                                                  [head])[0], dim=0))
    with pytest.raises(ollama.ResponseError) as err:
        c.embed("embedder", long, truncate=False)
    assert err.value.status_code == 400 and "maximum context length" in err.value.error
    assert c.embed("embedder", "").embeddings == []  # loads the model, embeds nothing
    legacy = c.embeddings("embedder", TEXTS[0]).embedding
    _close(legacy, reference_embeddings(last_token_checkpoint, text_ids[:1])[0])
    shorter = c.embed("embedder", TEXTS[0], dimensions=8).embeddings[0]
    assert len(shorter) == 8
    assert c.show("embedder").capabilities == ["embedding"]  # an embedding model, not a completion one


def test_score_and_rerank_are_the_cosines_of_the_embeddings(embed_server, last_token_checkpoint, text_ids):
    """vLLM's score and rerank APIs on an embedding model: the cosine similarity of the two texts'
    embeddings (transformers' here), one text against many or pairwise; rerank best first."""
    ref = reference_embeddings(last_token_checkpoint, text_ids)
    cos = [[float(torch.dot(a, b) / (a.norm() * b.norm())) for b in ref] for a in ref]
    r = httpx.post(f"{embed_server.url}/v1/score", json={"model": "embedder", "text_1": TEXTS[0], "text_2": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    assert [d["score"] for d in body["data"]] == pytest.approx(cos[0], abs=1e-4)
    assert body["usage"]["prompt_tokens"] == sum(map(len, text_ids))  # each distinct text embedded once
    pairwise = httpx.post(f"{embed_server.url}/score", json={"model": "embedder", "text_1": TEXTS[1:],
                                                              "text_2": TEXTS[:2]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([cos[1][0], cos[2][1]], abs=1e-4)
    ranked = httpx.post(f"{embed_server.url}/v1/rerank", json={"model": "embedder", "query": TEXTS[2],
                                                               "documents": TEXTS[:2] * 2, "top_n": 3}).json()
    want = sorted(range(4), key=lambda k: cos[2][k % 2], reverse=True)[:3]
    assert [r["index"] for r in ranked["results"]] == want
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([cos[2][k % 2] for k in want],
                                                                              abs=1e-4)
    assert [r["document"]["text"] for r in ranked["results"]] == [TEXTS[k % 2] for k in want]
    bare = httpx.post(f"{embed_server.url}/v2/rerank", json={"model": "embedder", "query": "x", "documents": ["y"],
                                                             "return_documents": False}).json()
    assert set(bare["results"][0]) == {"index", "relevance_score"}
    for path, body, param in (("/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS}, "text_1"),
                              ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
                              ("/rerank", {"query": "", "documents": ["a"]}, "query"),
                              ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n")):
        r = httpx.post(f"{embed_server.url}{path}", json={"model": "embedder", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _refused(call, status: int, param: str | None, message: str, code: str | None = None) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    assert info.value.status_code == status
    error = info.value.body
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code


def test_bad_input_gets_a_400_in_openai_shape_and_loses_nothing(embed_server):
    c = client(embed_server)
    create = c.embeddings.create
    _refused(lambda: create(model="embedder", input=[1] * 257), 400, "input", "maximum context length is 256",
             "context_length_exceeded")
    _refused(lambda: create(model="embedder", input=[[1, 2], "text"]), 400, "input", "input must be")
    _refused(lambda: create(model="embedder", input=[]), 400, "input", "input must be")
    _refused(lambda: create(model="embedder", input=""), 400, "input", "empty string")
    _refused(lambda: create(model="embedder", input=[1, 10**6]), 400, "input", "outside the vocabulary")
    _refused(lambda: create(model="embedder", input="hi", dimensions=0), 400, "dimensions", "1..64")
    _refused(lambda: create(model="embedder", input="hi", dimensions=65), 400, "dimensions", "1..64")
    _refused(lambda: create(model="embedder", input="hi", encoding_format="int8"), 400, "encoding_format",
             "float or base64")
    _refused(lambda: c.post("/embeddings", body={"model": "embedder", "input": "hi", "dimensions": "8"},
                            cast_to=object), 400, "dimensions", "Expected `int | null`")
    _refused(lambda: c.chat.completions.create(model="embedder", messages=[{"role": "user", "content": "hi"}]),
             400, "model", "is an embedding model", "model_not_generative")
    _refused(lambda: c.completions.create(model="embedder", prompt="hi"), 400, "model", "is an embedding model",
             "model_not_generative")
    _refused(lambda: c.responses.create(model="embedder", input="hi"), 400, "model", "is an embedding model",
             "model_not_generative")
    assert len(create(model="embedder", input="still here").data[0].embedding) == 64
    assert len(create(model="embedder", input=[1] * 256).data) == 1  # an input may fill the context


def test_an_oversized_body_gets_413(embed_server):
    body = b'{"model": "embedder", "input": "' + b"a" * (8 * 2**20) + b'"}'
    r = httpx.post(f"{embed_server.base_url}/embeddings", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_client_that_leaves_aborts_its_inputs(embed_server):
    engine = embed_server.engine
    aborted = metric(embed_server, 'neuron_request_finished_total{reason="abort"}')
    body = {"model": "embedder", "input": [[(i + j) % 250 for j in range(250)] for i in range(2048)]}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{embed_server.base_url}/embeddings", json=body, timeout=0.5)
    wait_until(lambda: not engine.open_streams and not engine.engine.has_unfinished(), 30,
               "the abandoned inputs still run")
    # those in the engine when the client left were aborted; the rest were never queued
    assert 0 < metric(embed_server, 'neuron_request_finished_total{reason="abort"}') - aborted <= engine.max_per_request
    assert len(client(embed_server).embeddings.create(model="embedder", input="after").data) == 1


def test_a_generation_model_refuses_embeddings(generation_checkpoint):
    with LiveServer(real_engine(str(generation_checkpoint), tp=1, name="writer")) as server:
        server.wait_ready()
        _refused(lambda: client(server).embeddings.create(model="writer", input=[1, 2, 3]), 400, "model",
                 "is a generation model", "model_not_embedding")
