"""LoRA adapters: PEFT folders served on the base model, mixed in one batch, split across ranks.

transformers + PEFT is the oracle: every adapter's greedy tokens are equal and its logprobs within
1e-3 of PEFT's, in a step that mixes three adapters and the bare base model."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import (
    assert_matches_reference,
    build_checkpoint,
    build_llama_checkpoint,
    build_lora_adapter,
    reference_lora_greedy,
)

from neuron import LLM, LoRARequest, SamplingParams
from neuron.errors import ConfigError, NeuronError
from neuron.layers.kernels import Kernels
from neuron.layers.lora import LoraPool, LoraRows
from neuron.models.lora import LoraError

NEW_TOKENS = 6
PROMPTS = [[5, 17, 200, 3], list(range(10, 50)), [7, 8], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True)


def _adapters(base, folder) -> dict:
    """Three adapters unlike each other: every projection at rank 4; rsLoRA at rank 8 on the MLP;
    q and v alone at rank 2."""
    return {
        "all": build_lora_adapter(base, folder / "all", seed=11, r=4, alpha=8),
        "rs_mlp": build_lora_adapter(base, folder / "rs_mlp", seed=12, r=8, alpha=4, use_rslora=True,
                                     targets=("gate_proj", "up_proj", "down_proj")),
        "qv": build_lora_adapter(base, folder / "qv", seed=13, r=2, alpha=16, targets=("q_proj", "v_proj")),
    }


@pytest.fixture(scope="module")
def qwen3_lora(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_qwen3")
    base = build_checkpoint(folder / "base", seed=3, vocab_size=301, num_key_value_heads=1, head_dim=24)
    return base, _adapters(base, folder)


@pytest.fixture(scope="module")
def llama_lora(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_llama")
    base = build_llama_checkpoint(folder / "base", seed=4)
    return base, _adapters(base, folder)


def _requests(adapters: dict) -> list[LoRARequest | None]:
    """One prompt per adapter and one for the base model."""
    return [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())] + [None]


def _check_mixed(base, adapters, tp: int, device: str = "cpu", **llm) -> None:
    requests = _requests(adapters)
    with LLM(str(base), tensor_parallel_size=tp, device=device, dtype="float32", enable_lora=True, max_loras=3,
             max_lora_rank=8, **llm) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=requests)
    for prompt, request, out in zip(PROMPTS, requests, outs):
        adapter = None if request is None else adapters[request.lora_name]
        ref = reference_lora_greedy(base, adapter, prompt, NEW_TOKENS)
        assert_matches_reference(out.outputs[0], *ref, f"adapter {request and request.lora_name}")


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_qwen3_mixed_batch_matches_peft(qwen3_lora, tp, small_prefill_chunks, monkeypatch):
    """Three adapters (attention and MLP, rsLoRA, q/v only) and the base model in one batch, one
    KV head replicated across ranks at tp 2 and 4: each equals transformers + PEFT. Its steps (of
    up to 16 rows) run the decoder layers in one C++ call, adapters included, the prompts' steps
    with their last layer for the rows the head reads alone (each with its adapter)."""
    from neuron.layers import cpu_decoder

    # steps with adapters through the C++ loop, those it left to Python, and those whose last layer
    # ran the kept rows alone
    ran = {"c": 0, "python": 0, "kept": 0}
    run = cpu_decoder.DecoderStack.run

    def counted(self, x, cos, sin, meta, lora_slots=None, with_logits=False, kept=None):
        out = run(self, x, cos, sin, meta, lora_slots, with_logits, kept)
        if lora_slots is not None:
            ran["c" if out is not None else "python"] += 1
            ran["kept"] += out is not None and kept is not None and kept.lora is not None
        return out

    monkeypatch.setattr(cpu_decoder.DecoderStack, "run", counted)
    _check_mixed(*qwen3_lora, tp)
    if tp == 1:  # rank 0 runs in this process
        assert ran["c"] > 0 and ran["python"] == 0 and ran["kept"] > 0, ran


def test_python_layers_apply_adapters_alone(qwen3_lora, monkeypatch):
    """With the C++ decoder loop off (NEURON_NO_FUSED_LAYERS), every step's adapters run in the
    Python layers' grouped product, equal to PEFT too."""
    monkeypatch.setenv("NEURON_NO_FUSED_LAYERS", "1")
    _check_mixed(*qwen3_lora, 1)


@pytest.mark.gpu
def test_mixed_batch_on_cuda_runs_the_triton_kernel_and_matches_peft(qwen3_lora, monkeypatch):
    """On CUDA in fp32, steps mixing three adapters and the base model run the Triton kernels
    (layers/triton_lora.py, trusted by the start-up self-check) and equal transformers + PEFT."""
    from neuron.layers import lora

    calls = []
    kernel = lora.grouped_triton
    monkeypatch.setattr(lora, "grouped_triton", lambda *args: calls.append(1) or kernel(*args))
    _check_mixed(*qwen3_lora, 1, device="cuda")
    assert calls, "no step ran the Triton kernel"


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_llama_mixed_batch_matches_peft(llama_lora, tp):
    _check_mixed(*llama_lora, tp)


def test_swapped_adapters_stay_isolated_with_prefix_caching(qwen3_lora):
    """The same long prompt for three adapters and the base, twice over, through two adapter slots
    with prefix caching on: adapters wait for a slot and swap in LRU, the second round finds its
    prefix cached, and every request gets its own adapter's output."""
    base, adapters = qwen3_lora
    prompt = list(range(20, 70))  # three full blocks of 16 tokens to cache
    requests = _requests(adapters) * 2
    with LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
             enable_prefix_caching=True) as llm:
        outs = llm.generate([{"prompt_token_ids": prompt}] * len(requests), GREEDY, lora_request=requests)
        queries, hits = llm.engine.prefix_cache_counts()
    assert hits > 0
    tokens = {}
    for request, out in zip(requests, outs):
        adapter = None if request is None else adapters[request.lora_name]
        assert_matches_reference(out.outputs[0], *reference_lora_greedy(base, adapter, prompt, NEW_TOKENS))
        tokens.setdefault(request and request.lora_name, out.outputs[0].token_ids)
        assert tokens[request and request.lora_name] == out.outputs[0].token_ids
    assert len({tuple(t) for t in tokens.values()}) == len(tokens), "adapters whose outputs differ"


@pytest.mark.parametrize("seq_slots,lengths", [
    ([2, -1, 0, 2], [3, 2, 1, 2]),  # two of four slots, groups of 5 and 1 rows (padded), base rows between
    ([3, 1, 0, 2, 1], [1, 1, 2, 1, 1]),  # every slot: no gather
    ([1, 1], [4, 1]),  # one adapter for every row: two plain products
    ([-1, 3], [2, 3]),  # one adapter and the base
])
def test_grouped_product_equals_each_row_alone(seq_slots, lengths):
    """The grouped product over a step's rows equals each row's own x A^T B^T, and exactly zero
    for the base model's rows."""
    torch.manual_seed(0)
    pool = LoraPool(4, 3, 8, [(0, 5), (5, 2)], torch.float32, "cpu", Kernels())
    weights = {}
    for slot in range(4):
        for part, (_, size) in enumerate(pool.parts):
            a, b = torch.randn(2 + slot % 2, 8), torch.randn(size, 2 + slot % 2)
            pool.set(slot, part, a, b)
            weights[slot, part] = (a, b)
    x = torch.randn(sum(lengths), 8)
    got = pool.delta(x, LoraRows.build(seq_slots, lengths, 4, "cpu"))
    row_slots = [s for s, n in zip(seq_slots, lengths) for _ in range(n)]
    for i, slot in enumerate(row_slots):
        if slot < 0:
            assert torch.equal(got[i], torch.zeros(7))
            continue
        want = torch.cat([x[i] @ weights[slot, p][0].T @ weights[slot, p][1].T for p in range(2)])
        torch.testing.assert_close(got[i], want)
    assert LoraRows.build([-1, -1], [1, 1], 4, "cpu") is None


# ---- bad adapters: refused by name, nothing loaded harmed ----


@pytest.fixture(scope="module")
def bad_adapters(qwen3_lora, tmp_path_factory):
    base, _ = qwen3_lora
    folder = tmp_path_factory.mktemp("lora_bad")
    wide = build_checkpoint(folder / "wide", seed=5, hidden_size=32, head_dim=8)
    deep = build_checkpoint(folder / "deep", seed=6, num_hidden_layers=3, vocab_size=301, num_key_value_heads=1,
                            head_dim=24)
    saved = build_lora_adapter(base, folder / "saved", seed=7)
    config = json.loads((saved / "adapter_config.json").read_text())
    (saved / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    unknown = build_lora_adapter(base, folder / "unknown", seed=8)
    config = json.loads((unknown / "adapter_config.json").read_text())
    (unknown / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "c_attn"]}))
    no_weights = build_lora_adapter(base, folder / "no_weights", seed=9)
    (no_weights / "adapter_model.safetensors").unlink()
    return {
        "hidden_size 32": (build_lora_adapter(wide, folder / "wide_lora", seed=1), "trained on another base"),
        "layer count": (build_lora_adapter(deep, folder / "deep_lora", seed=1, targets=("o_proj",)),
                        "is for layer 2, but the base model has 2 layers"),
        "rank": (build_lora_adapter(base, folder / "r16", seed=1, r=16), "rank 16 exceeds --max-lora-rank 8"),
        "missing folder": (folder / "nowhere", "no such folder"),
        "missing file": (no_weights, "adapter_model.safetensors is missing"),
        "unknown target": (unknown, "target module 'c_attn' is not supported"),
        "modules_to_save": (saved, "modules_to_save"),
    }


def test_bad_adapters_are_refused_by_name(qwen3_lora, bad_adapters):
    base, adapters = qwen3_lora
    good = LoRARequest("all", 1, str(adapters["all"]))
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        before = llm.generate(prompt, GREEDY, lora_request=good)[0].outputs[0].token_ids
        for i, (what, (path, message)) in enumerate(bad_adapters.items()):
            with pytest.raises(LoraError, match=message):
                llm.generate(prompt, GREEDY, lora_request=LoRARequest(f"bad{i}", 10 + i, str(path)))
            assert f"bad{i}" not in llm.engine.loras.adapters, what
        assert llm.generate(prompt, GREEDY, lora_request=good)[0].outputs[0].token_ids == before
        with pytest.raises(ConfigError, match="is loaded with id 1"):
            llm.generate(prompt, GREEDY, lora_request=LoRARequest("all", 2, str(adapters["all"])))


def test_lora_with_speculative_decoding_is_refused(qwen3_lora):
    base, _ = qwen3_lora
    with pytest.raises(ConfigError, match="speculative decoding with LoRA adapters is not supported"):
        LLM(str(base), device="cpu", dtype="float32", enable_lora=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})



def test_an_adapter_the_ranks_cannot_read_fails_its_step_alone(qwen3_lora, tmp_path):
    """An adapter whose files vanish after it was checked: its request ends with the ranks' reason,
    and the next request (another adapter) is served."""
    import shutil

    base, adapters = qwen3_lora
    gone = shutil.copytree(adapters["qv"], tmp_path / "gone")
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        llm.engine.loras.register("gone", str(gone))
        (gone / "adapter_model.safetensors").unlink()
        with pytest.raises(NeuronError, match="load_failed: LoRA adapter .*adapter_model.safetensors is missing"):
            llm.engine.add_request("x", PROMPTS[0], GREEDY, lora="gone")
            while llm.engine.has_unfinished():
                for u in llm.engine.step():
                    if u.error:
                        raise NeuronError(u.error)
        out = llm.generate(prompt, GREEDY, lora_request=LoRARequest("all", 1, str(adapters["all"])))[0].outputs[0]
        assert_matches_reference(out, *reference_lora_greedy(base, adapters["all"], PROMPTS[0], NEW_TOKENS))


# ---- serving: adapters by name, loaded and unloaded while other requests stream ----


@pytest.fixture(scope="module")
def served_lora(tmp_path_factory):
    """The embedded default checkpoint (it has a tokenizer) and three adapters of it: two of rank 4,
    one of rank 16 (over the server's --max-lora-rank 8)."""
    import shutil

    from neuron.utils.default_checkpoint import default_model_dir

    folder = tmp_path_factory.mktemp("lora_served")
    base = shutil.copytree(default_model_dir(), folder / "base")
    return base, {"sql": build_lora_adapter(base, folder / "sql", seed=21),
                  "chat": build_lora_adapter(base, folder / "chat", seed=22, targets=("q_proj", "down_proj")),
                  "wide": build_lora_adapter(base, folder / "wide", seed=23, r=16)}


def _completion_ids(server, model: str, prompt: list[int], max_tokens: int = NEW_TOKENS) -> list[int]:
    from server_harness import client, token_ids

    out = client(server).completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                            logprobs=1, extra_body={"ignore_eos": True,
                                                                    "return_tokens_as_token_ids": True})
    return token_ids(out.choices[0].logprobs)


def _stream_gaps(server, model: str, max_tokens: int, body: dict | None = None) -> tuple[list[float], list[dict]]:
    """Stream a completion; the seconds between its chunks, and the chunks."""
    import time

    import httpx

    gaps, chunks, last = [], [], None
    payload = {"model": model, "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
               "ignore_eos": True, **(body or {})}
    with httpx.stream("POST", f"{server.base_url}/completions", json=payload, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            chunks.append(json.loads(line[6:]))
    return gaps, chunks


def test_adapters_are_served_by_name_and_loaded_while_serving(served_lora):
    """--lora-modules serves an adapter as a model whose parent is the base; another is loaded
    through vLLM's route and through the admin API, used and unloaded while a request for the
    base streams with no gap of a second; a bad adapter is refused (400/409 naming it) and what is
    loaded keeps its output; an adapter unloaded with a request in flight ends it cleanly; one
    loaded with a keep_alive is unloaded once idle that long."""
    import threading

    import httpx
    from server_harness import LiveServer, real_engine, wait_until

    from neuron.entrypoints.openai.app import ServerConfig

    base, adapters = served_lora
    prompt = [5, 17, 200, 3]
    engine = real_engine(str(base), 1, name="base", enable_lora=True, max_loras=1, max_lora_rank=8,
                         lora_modules=f"sql={adapters['sql']}")
    with LiveServer(engine, ServerConfig(admin_key="admin", allow_runtime_lora_updating=True)) as server:
        server.wait_ready()
        cards = {c["id"]: c for c in httpx.get(f"{server.base_url}/models").json()["data"]}
        assert cards["sql"]["parent"] == "base" and cards["base"]["parent"] is None
        sql = _completion_ids(server, "sql", prompt)
        assert sql == reference_lora_greedy(base, adapters["sql"], prompt, NEW_TOKENS)[0]
        assert _completion_ids(server, "base", prompt) == reference_lora_greedy(base, None, prompt, NEW_TOKENS)[0]

        streamed = {}
        thread = threading.Thread(target=lambda: streamed.update(gaps=_stream_gaps(server, "base", 1500)[0]))
        thread.start()
        wait_until(lambda: engine.open_streams, 10, "the base model's stream did not start")

        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(f"{server.base_url}/{path}", json=body, timeout=30)

        assert post("load_lora_adapter", {"lora_name": "chat", "lora_path": str(adapters["chat"])}).status_code == 200
        chat = _completion_ids(server, "chat", prompt)  # swaps sql out of the one slot
        assert chat == reference_lora_greedy(base, adapters["chat"], prompt, NEW_TOKENS)[0] and chat != sql
        refused = {"rank": post("load_lora_adapter", {"lora_name": "w", "lora_path": str(adapters["wide"])}),
                   "missing": post("load_lora_adapter", {"lora_name": "m", "lora_path": str(base / "nowhere")}),
                   "taken": post("load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapters["chat"])})}
        assert refused["rank"].status_code == 400 and "rank 16 exceeds --max-lora-rank 8" in refused["rank"].text
        assert refused["missing"].status_code == 400 and "no such folder" in refused["missing"].text
        assert refused["taken"].status_code == 409
        admin = {"authorization": "Bearer admin"}
        loaded = httpx.post(f"{server.url}/admin/models", json={"name": "sql2", "lora": str(adapters["sql"]),
                                                                  "base": "base"}, headers=admin, timeout=30)
        assert loaded.status_code == 201, loaded.text
        assert _completion_ids(server, "sql2", prompt) == sql
        assert httpx.delete(f"{server.url}/admin/models/sql2", headers=admin).status_code == 200
        assert engine.open_streams, "the base model's stream ended before the adapters were loaded and unloaded"
        thread.join(60)
        assert streamed["gaps"] and max(streamed["gaps"]) < 1.0
        assert _completion_ids(server, "sql", prompt) == sql  # what was loaded is unharmed

        cut = {}
        thread = threading.Thread(target=lambda: cut.update(chunks=_stream_gaps(server, "chat", 5000)[1]))
        thread.start()
        wait_until(lambda: engine.open_streams, 10, "the adapter's stream did not start")
        assert post("unload_lora_adapter", {"lora_name": "chat"}).status_code == 200
        thread.join(30)
        assert not thread.is_alive() and cut["chunks"][-1]["error"]["code"] == "model_unloaded"
        assert post("unload_lora_adapter", {"lora_name": "chat"}).status_code == 404
        gone = post("completions", {"model": "chat", "prompt": prompt, "max_tokens": 2})
        assert gone.status_code == 404 and "chat" in gone.text
        assert "chat" not in {c["id"] for c in httpx.get(f"{server.base_url}/models").json()["data"]}
        wait_until(lambda: not engine.engine.loras.forgets, 10, "the ranks still hold the unloaded adapter")
        assert _completion_ids(server, "sql", prompt) == sql

        brief = httpx.post(f"{server.url}/admin/models", json={"name": "brief", "lora": str(adapters["chat"]),
                                                                 "keep_alive": 0}, headers=admin, timeout=30)
        assert brief.status_code == 201, brief.text
        assert _completion_ids(server, "brief", prompt) == chat
        wait_until(lambda: "brief" not in {c["id"] for c in httpx.get(f"{server.base_url}/models").json()["data"]},
                   10, "an adapter idle past its keep_alive is still served")
        assert "sql" in {c["id"] for c in httpx.get(f"{server.base_url}/models").json()["data"]}  # kept for good


def test_the_memory_plan_counts_the_adapter_pool(qwen3_lora):
    """The pre-flight's bytes per rank grow by exactly what the ranks' pools hold."""
    from checkpoints import model_config

    from neuron.models import text_config
    from neuron.models.memory_plan import lora_pool_bytes

    base, _ = qwen3_lora
    config = text_config(model_config(base).hf_config)
    with LLM(str(base), tensor_parallel_size=1, device="cpu", dtype="float32", enable_lora=True, max_loras=3,
             max_lora_rank=8) as llm:
        model = llm.engine.executor.rank0.models["model"].model
        pools = [pool for layer in model.layers for pool in (layer.attn.qkv.lora, layer.attn.o_proj.lora,
                                                             layer.mlp.gate_up.lora, layer.mlp.down.lora)]
        assert sum(pool.nbytes() for pool in pools) == lora_pool_bytes(config, 1, 3, 8, 4)


@pytest.mark.slow
def test_the_benchmark_runs_on_a_tiny_model():
    """scripts/bench_lora.py end to end on a tiny model (its figures mean nothing there)."""
    import runpy
    from pathlib import Path

    bench = runpy.run_path(str(Path(__file__).resolve().parent.parent / "scripts" / "bench_lora.py"))
    result = bench["main"](["--tiny", "--adapters", "3", "--requests", "4", "--rank", "4"])
    assert result["mixed_lora_tok_s"] > 0 and result["batch1_base_tok_s"] > 0
    assert result["mixed_ratio"] == result["mixed_lora_tok_s"] / result["mixed_base_tok_s"]


def test_adapters_load_again_after_the_ranks_are_rebuilt(qwen3_lora):
    """A rebuild of the ranks (as after a rank failure) empties their adapter pools; the next
    request for an adapter loads it anew and gets its output."""
    base, adapters = qwen3_lora
    request = LoRARequest("qv", 3, str(adapters["qv"]))
    ref = reference_lora_greedy(base, adapters["qv"], PROMPTS[2], NEW_TOKENS)
    with LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        assert_matches_reference(llm.generate({"prompt_token_ids": PROMPTS[2]}, GREEDY, lora_request=request)[0]
                                 .outputs[0], *ref)
        llm.engine.restart()
        assert llm.engine.loras.resident() == []
        assert_matches_reference(llm.generate({"prompt_token_ids": PROMPTS[2]}, GREEDY, lora_request=request)[0]
                                 .outputs[0], *ref)


def test_serve_takes_lora_modules_as_vllm_does(monkeypatch):
    """`--lora-modules a=PATH b=PATH` (or NEURON_LORA_MODULES, comma-separated) turns adapters on;
    an entry that is not NAME=PATH, or a name given twice, is refused before anything loads."""
    from neuron.engine.engine_config import EngineConfig, parse_lora_modules
    from neuron.entrypoints import serve
    from neuron.entrypoints.cli import _parser

    engine, _ = serve.configs(_parser().parse_args(["serve", "base", "--lora-modules", "a=/x", "b=/y/z",
                                                    "--max-loras", "2"]))
    assert engine.enable_lora and engine.max_loras == 2 and engine.max_lora_rank == 16
    assert parse_lora_modules(engine.lora_modules) == [("a", "/x"), ("b", "/y/z")]
    monkeypatch.setenv("NEURON_LORA_MODULES", "a=/x,b=/y")
    assert EngineConfig().enable_lora
    with pytest.raises(ConfigError, match="NAME=PATH entries, got 'a'"):
        EngineConfig(lora_modules="a")
    with pytest.raises(ConfigError, match="names the adapter 'a' twice"):
        EngineConfig(lora_modules="a=/x a=/y")
    from neuron.engine.host import ModelSpec  # a models file's entry: a list, or a mapping

    for given in (["a=/x", "b=/y"], {"a": "/x", "b": "/y"}):
        spec = ModelSpec.parse({"name": "m", "model": "base", "lora_modules": given}, EngineConfig(), "entry")
        assert spec.engine.enable_lora and parse_lora_modules(spec.engine.lora_modules) == [("a", "/x"), ("b", "/y")]


def test_prompt_logprobs_and_samples_run_the_adapter(qwen3_lora):
    """Echo's prompt logprobs and every sample of n come from the adapter's model, as PEFT's."""
    from checkpoints import lora_reference_model

    base, adapters = qwen3_lora
    prompt = PROMPTS[3]
    peft = lora_reference_model(base, adapters["all"])
    with torch.no_grad():
        want = torch.log_softmax(peft(torch.tensor([prompt])).logits[0].float(), -1)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, n=2, prompt_logprobs=1, logprobs=5,
                            ignore_eos=True)
    with LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, params,
                           lora_request=LoRARequest("all", 1, str(adapters["all"])))[0]
    got = [lp[token] for lp, token in zip(out.prompt_logprobs[1:], prompt[1:])]
    torch.testing.assert_close(torch.tensor(got), want[torch.arange(len(prompt) - 1), prompt[1:]], atol=1e-3, rtol=0)
    ref = reference_lora_greedy(base, adapters["all"], prompt, NEW_TOKENS)
    for sample in out.outputs:
        assert_matches_reference(sample, *ref)


def test_a_model_without_adapters_refuses_them(default_tokenizer, served_lora):
    """vLLM's routes are off (404) unless --allow-runtime-lora-updating; with it, a server whose
    model was started without --enable-lora answers 400 to a load, naming why, and 404 to an
    unload of an unknown adapter."""
    import httpx
    from server_harness import LiveServer, ScriptedEngine, scripted_engine

    _, adapters = served_lora
    from neuron.entrypoints.openai.app import ServerConfig

    with LiveServer(scripted_engine(ScriptedEngine(default_tokenizer, {}))) as server:  # vLLM's routes off
        server.wait_ready(10)
        assert httpx.post(f"{server.base_url}/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/x"}
                          ).status_code == 404
    with LiveServer(scripted_engine(ScriptedEngine(default_tokenizer, {})),
                    ServerConfig(allow_runtime_lora_updating=True)) as server:
        server.wait_ready(10)
        load = httpx.post(f"{server.base_url}/load_lora_adapter",
                          json={"lora_name": "sql", "lora_path": str(adapters["sql"])})
        assert load.status_code == 400 and "no model serves LoRA adapters" in load.json()["error"]["message"]
        named = httpx.post(f"{server.base_url}/load_lora_adapter",
                           json={"lora_name": "sql", "lora_path": str(adapters["sql"]), "base_model_name": "stub"})
        assert named.status_code == 400 and "model `stub` does not serve LoRA adapters" in named.text
        assert httpx.post(f"{server.base_url}/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 404
        assert [m["id"] for m in httpx.get(f"{server.base_url}/models").json()["data"]] == ["stub"]


@pytest.mark.slow
def test_ollamas_clients_name_adapters_as_models(served_lora):
    """Through Ollama's API an adapter is a model: /api/tags and /api/ps list it with its base as
    parent_model, /api/show describes it, `NAME:latest` reaches it, a raw generate gives the
    adapter's greedy tokens (PEFT's), and keep_alive 0 takes the adapter's weights off the ranks
    once it is idle (it leaves /api/ps) while it stays served, its next request loading them again."""
    from server_harness import LiveServer, ollama_client, real_engine, wait_until

    base, adapters = served_lora
    prompt = [5, 17, 200, 3]
    engine = real_engine(str(base), 1, name="base", enable_lora=True, max_loras=2, max_lora_rank=8,
                         lora_modules=f"sql={adapters['sql']} chat={adapters['chat']}")
    with LiveServer(engine) as server:
        server.wait_ready()
        client = ollama_client(server)
        tags = {m.model: m for m in client.list().models}
        assert set(tags) == {"base", "sql", "chat"}
        assert tags["sql"].details.parent_model == "base" and tags["base"].details.parent_model == ""
        assert tags["sql"].digest != tags["chat"].digest and tags["sql"].size > 0
        shown = client.show("sql:latest")
        assert shown.details.parent_model == "base" and shown.modelinfo["general.architecture"] == "qwen3"
        ps = {m.model: m for m in client.ps().models}
        assert {"base", "sql", "chat"} <= set(ps) and ps["chat"].details.parent_model == "base"

        text = server.engine.tokenizer.decode(prompt, skip_special_tokens=False)
        out = client.generate(model="sql:latest", prompt=text, raw=True,
                              options={"temperature": 0, "num_predict": NEW_TOKENS})
        expected = reference_lora_greedy(base, adapters["sql"], prompt, NEW_TOKENS)[0]
        assert out.response == server.engine.tokenizer.decode(expected, skip_special_tokens=False)

        def running() -> set[str]:
            return {m.model for m in client.ps().models}

        loras = server.engine.engine.loras
        chat_id = loras.adapters["chat"].lora_id
        client.generate(model="chat", prompt=text, raw=True, keep_alive=0, options={"num_predict": 1})
        wait_until(lambda: "chat" not in running(), 30, "keep_alive 0 did not rest the idle adapter's weights")
        assert running() == {"base", "sql"}  # the other adapter, which has no keep_alive, stays
        assert "chat" not in loras.resident() and loras.adapters["chat"].lora_id != chat_id
        # one client's keep_alive never takes the adapter from the others: it stays served, and its
        # next request loads its weights again
        assert {m.model for m in client.list().models} == {"base", "sql", "chat"}
        again = client.generate(model="chat", prompt=text, raw=True,
                                options={"temperature": 0, "num_predict": NEW_TOKENS})
        expected = reference_lora_greedy(base, adapters["chat"], prompt, NEW_TOKENS)[0]
        assert again.response == server.engine.tokenizer.decode(expected, skip_special_tokens=False)
        assert "chat" in running() and "chat" in loras.resident()


def test_host_copies_are_bounded_by_bytes_least_recently_used_out():
    from neuron.utils.lru import SizedLRU

    host = SizedLRU(max_bytes=1000)
    host.put(1, "a", 400)
    host.put(2, "b", 400)
    assert host.get(1) == "a"  # 1 is now the most recently used
    host.put(3, "c", 400)
    assert 2 not in host and 1 in host and 3 in host and host.nbytes == 800
    assert not host.put(4, "d", 1200)  # larger than the whole budget: not kept, nothing else lost
    assert 4 not in host and host.nbytes == 800
    host.put(1, "a", 400)  # put again: counted once
    assert host.nbytes == 800
    host.pop(1)
    assert host.nbytes == 400 and list(host.entries) == [3]


def test_adapters_beyond_the_host_budget_are_read_again_when_needed(qwen3_lora):
    """One pool slot and host memory for one adapter: serving three in turn swaps each in from its
    folder again, each request still gets its own adapter's output, and the host copies stay
    within the budget."""
    from neuron.utils.lru import SizedLRU

    base, adapters = qwen3_lora
    names = list(adapters)
    with LLM(str(base), tensor_parallel_size=1, device="cpu", dtype="float32", enable_lora=True, max_loras=1,
             max_lora_rank=8) as llm:
        runner = llm.engine.executor.rank0.models["model"]
        requests = [LoRARequest(name, i + 1, str(adapters[name])) for i, name in enumerate(names)]
        llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 3, GREEDY, lora_request=requests)
        sizes = [size for _, size in runner.lora_host.entries.values()]
        assert len(sizes) == 3 and len(set(sizes)) == 3  # the three adapters' shares differ in size
        runner.lora_host = SizedLRU(max(sizes))  # room for the largest alone
        for request in requests + requests[:1]:
            out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, lora_request=request)[0]
            ref = reference_lora_greedy(base, adapters[request.lora_name], PROMPTS[0], NEW_TOKENS)
            assert_matches_reference(out.outputs[0], *ref, request.lora_name)
            assert runner.lora_host.nbytes <= max(sizes) and len(runner.lora_host.entries) == 1


# ---- a mixture-of-experts base: adapters on the attention and the dense MLP layers ----


@pytest.fixture(scope="module")
def moe_lora(tmp_path_factory):
    """test_moe.py's Qwen3-MoE (layers 0 and 2 of experts, layer 1 dense) with an adapter on the
    attention, and one that also targets the MLPs: PEFT puts it on layer 1's dense MLP and on the
    experts' fused weights."""
    from test_moe import _build

    folder = tmp_path_factory.mktemp("lora_moe")
    base = _build(folder / "base", seed=3, norm_topk_prob=True)
    return base, {
        "attn": build_lora_adapter(base, folder / "attn", seed=31, r=4, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
        "everywhere": build_lora_adapter(base, folder / "everywhere", seed=32, r=4,
                                         targets=("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    }


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_attention_adapters_on_a_moe_model_match_peft(moe_lora, tp, small_prefill_chunks):
    base, adapters = moe_lora
    requests = [LoRARequest("attn", 1, str(adapters["attn"])), None]
    with LLM(str(base), tensor_parallel_size=tp, device="cpu", dtype="float32", enable_lora=True, max_loras=1,
             max_lora_rank=8) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY, lora_request=requests)
        with pytest.raises(LoraError, match="target_parameters.*mixture-of-experts block's experts"):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY,
                         lora_request=LoRARequest("everywhere", 2, str(adapters["everywhere"])))
    for prompt, request, out in zip(PROMPTS, requests, outs):
        ref = reference_lora_greedy(base, None if request is None else adapters["attn"], prompt, NEW_TOKENS)
        assert_matches_reference(out.outputs[0], *ref, f"adapter {request and request.lora_name}")


def test_the_memory_plan_counts_no_pool_beside_the_experts(moe_lora):
    from test_moe import MOE

    from neuron.models.memory_plan import lora_pool_bytes

    dense = {**MOE, "num_experts": 0}
    slots, rank, h, inter = 2, 8, MOE["hidden_size"], MOE["intermediate_size"]
    mlp_pools = 4 * slots * rank * (2 * (h + 2 * inter) + (inter + h))  # gate/up's A and B^T, down's
    # the two layers of experts hold no MLP pool; the dense layer and every attention do
    assert lora_pool_bytes(dense, 1, slots, rank, 4) - lora_pool_bytes(MOE, 1, slots, rank, 4) == 2 * mlp_pools


def test_an_adapter_of_one_expert_is_refused_by_name(moe_lora, tmp_path):
    """An adapter naming one expert's projection (PEFT before fused experts wrote them so), or a
    mixture-of-experts layer's MLP, is refused naming the tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    from neuron.models.lora import PeftAdapter

    base, adapters = moe_lora
    config = json.loads((base / "config.json").read_text())
    for name, bad in {"expert": "base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_{}.weight",
                      "moe layer": "base_model.model.model.layers.2.mlp.gate_proj.lora_{}.weight"}.items():
        folder = shutil.copytree(adapters["attn"], tmp_path / name.replace(" ", "_"))
        tensors = load_file(folder / "adapter_model.safetensors")
        a = next(k for k in tensors if k.endswith("layers.0.self_attn.q_proj.lora_A.weight"))
        tensors[bad.format("A")] = tensors.pop(a)
        tensors[bad.format("B")] = tensors.pop(a.replace("lora_A", "lora_B"))
        save_file(tensors, folder / "adapter_model.safetensors")
        with pytest.raises(LoraError, match="mixture of experts|mixture-of-experts") as refused:
            PeftAdapter.open(folder, config, 8)
        assert bad.format("A") in str(refused.value) or bad.format("B") in str(refused.value), name


# ---- hostile adapter files: each refused with a clear error, the server unharmed ----


def _hostile_adapters(good, root) -> dict:
    """Variants of a good adapter folder, each broken one way, and what its refusal must say."""
    import shutil
    import struct

    from safetensors.torch import load_file, save_file

    cases = {}

    def variant(name: str, message: str, change) -> None:
        folder = shutil.copytree(good, root / name)
        change(folder)
        cases[name] = (folder, message)

    def config(edit):
        def change(folder):
            path = folder / "adapter_config.json"
            path.write_text(edit(json.loads(path.read_text())) if callable(edit) else edit)
        return change

    def tensors(edit):
        def change(folder):
            t = load_file(folder / "adapter_model.safetensors")
            edit(t)
            save_file(t, folder / "adapter_model.safetensors")
        return change

    def raw(data: bytes):
        return lambda folder: (folder / "adapter_model.safetensors").write_bytes(data)

    def first(t, which="A"):
        return next(k for k in sorted(t) if k.endswith(f"lora_{which}.weight"))

    def nan(t):
        t[first(t)][0, 0] = float("nan")

    def wrong_dtype(t):
        t[first(t)] = t[first(t)].to(torch.int32)

    def far_layer(t):
        a = first(t)
        t[a.replace("layers.0.", "layers.99999999999999999999.")] = t.pop(a)
        t[a.replace("layers.0.", "layers.99999999999999999999.").replace("lora_A", "lora_B")] = t.pop(
            a.replace("lora_A", "lora_B"))

    variant("config-not-json", "adapter_config.json", config("{not json"))
    variant("config-a-list", "not a LoRA adapter", config(lambda c: "[1, 2]"))
    variant("rank-a-string", "r must be a positive integer", config(lambda c: json.dumps({**c, "r": "4"})))
    variant("rank-huge", "exceeds --max-lora-rank", config(lambda c: json.dumps({**c, "r": 10**12})))
    variant("alpha-nan", "lora_alpha must be a number", config(lambda c: json.dumps({**c, "lora_alpha": "NaN"})))
    variant("rank-disagrees", "has shape", config(lambda c: json.dumps({**c, "r": 2})))
    variant("header-huge", "adapter_model.safetensors", raw(struct.pack("<Q", 1 << 60) + b"{}"))
    variant("header-not-json", "adapter_model.safetensors", raw(struct.pack("<Q", 8) + b"not json" + b"\0" * 64))
    variant("empty-file", "adapter_model.safetensors", raw(b""))
    variant("far-layer", "but the base model has 2 layers", tensors(far_layer))
    variant("integer-tensor", "lora_A", tensors(wrong_dtype))
    variant("nan-value", "not finite", tensors(nan))
    return cases


def test_hostile_adapter_files_are_refused_by_name(qwen3_lora, tmp_path):
    base, adapters = qwen3_lora
    good = LoRARequest("all", 1, str(adapters["all"]))
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        before = llm.generate(prompt, GREEDY, lora_request=good)[0].outputs[0].token_ids
        wrong = []
        for i, (name, (folder, message)) in enumerate(_hostile_adapters(adapters["all"], tmp_path).items()):
            try:
                llm.generate(prompt, GREEDY, lora_request=LoRARequest(name, 10 + i, str(folder)))
                wrong.append(f"{name}: served")
            except NeuronError as exc:
                if message not in str(exc):
                    wrong.append(f"{name}: {type(exc).__name__}: {exc}")
            assert llm.generate(prompt, GREEDY, lora_request=good)[0].outputs[0].token_ids == before, name
        assert not wrong, "\n".join(wrong)


def test_structured_output_holds_on_an_adapters_tokens(served_lora):
    """A grammar constrains a request for an adapter as it does one for the base model: the reply
    matches the regex."""
    import re

    from neuron import GuidedDecodingParams

    base, adapters = served_lora
    pattern = r"(yes|no)-[0-9]{2}"
    params = SamplingParams(temperature=0.0, max_tokens=12, guided_decoding=GuidedDecodingParams(regex=pattern))
    with LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        for request in (LoRARequest("sql", 1, str(adapters["sql"])), None):
            text = llm.generate("Answer:", params, lora_request=request)[0].outputs[0].text
            assert re.fullmatch(pattern, text), (request, text)
