"""A model host: several models in one server, loaded, listed and unloaded while it runs
(neuron/engine/host.py, the admin API, `neuron models`, `neuron serve` with several models)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import threading
import time

import httpx
import pytest
from checkpoints import build_checkpoint
from family_chat import build_family_checkpoint
from server_harness import LiveServer, ServeProcess, client, gone, wait_until

from neuron import LLM, SamplingParams
from neuron.engine.engine_config import EngineConfig
from neuron.engine.host import ModelHost, ModelSpec, read_models_file
from neuron.entrypoints.cli import run_command
from neuron.entrypoints.openai.app import ServerConfig
from neuron.errors import ConfigError
from neuron.utils import procfs

ADMIN = "admin-secret"
DEFAULTS = EngineConfig(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4)
PROMPTS = [[5, 17, 20, 3], [7, 8, 9, 7, 8, 9]]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("qwen"), seed=5)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_family_checkpoint(tmp_path_factory.mktemp("llama"), "llama3", seed=6)


def spec(name: str, model, **kw) -> ModelSpec:
    return ModelSpec.parse({"name": name, "model": str(model), **kw}, DEFAULTS, "test")


def greedy(server, name: str, prompt: list[int]) -> tuple[list[str], list[float]]:
    r = client(server).completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0, logprobs=1,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs


def alone(path, prompt: list[int], tp: int = 1) -> tuple[list[str], list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32", max_model_len=128) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    return [f"token_id:{t}" for t in out.token_ids], [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]


def admin(server, method: str, path: str, key: str | None = ADMIN, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{server.url}{path}", headers=headers, timeout=300, **kw)


# ---- specs ----


def test_a_spec_takes_the_documented_keys_over_the_command_line_defaults(tmp_path):
    s = spec("a", "/models/x", tp=2, devices=None, keep_alive=-1, load="on_demand", dtype="bfloat16")
    assert (s.name, s.engine.model, s.engine.tp, s.engine.dtype, s.engine.max_num_seqs) == \
        ("a", "/models/x", 2, "bfloat16", 4)
    assert (s.load, s.keep_alive_s) == ("on_demand", None)  # -1: never
    assert spec("b", "/m", load="on_demand").keep_alive_s == 300  # Ollama's default for on-demand models
    assert spec("c", "/m").keep_alive_s is None  # start-up models stay
    with pytest.raises(Exception, match=r"unknown key\(s\) 'gpus'; a spec takes name, model, tp, devices"):
        spec("d", "/m", gpus=[0])
    with pytest.raises(Exception, match="keep_alive must be seconds"):
        spec("e", "/m", keep_alive="5m")
    with pytest.raises(Exception, match="load must be startup or on_demand"):
        spec("f", "/m", load="lazy")
    with pytest.raises(Exception, match="name must be a non-empty string"):
        ModelSpec.parse({"name": "a/b", "model": "/m"}, DEFAULTS, "test")


def test_a_models_file_is_json_or_yaml_and_refused_in_one_line(tmp_path):
    yaml_file = tmp_path / "models.yaml"
    yaml_file.write_text("models:\n  - name: a\n    model: /m/a\n    tp: 2\n  - {name: b, model: /m/b, load: on_demand}\n")
    assert [(s.name, s.engine.tp, s.load) for s in read_models_file(yaml_file, DEFAULTS)] == \
        [("a", 2, "startup"), ("b", 1, "on_demand")]
    json_file = tmp_path / "models.json"
    json_file.write_text(json.dumps([{"name": "a", "model": "/m/a"}, {"name": "a", "model": "/m/b"}]))
    with pytest.raises(ConfigError, match="the model name 'a' is given twice"):
        read_models_file(json_file, DEFAULTS)
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {name: a, model: /m, colour: red}\n")
    with pytest.raises(ConfigError, match=r"entry 1: unknown key\(s\) 'colour'"):
        read_models_file(bad, DEFAULTS)
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text('a: &a ["x","x"]\nb: &b [*a,*a]\nmodels: [*b]\n')
    with pytest.raises(ConfigError, match="aliases"):
        read_models_file(bomb, DEFAULTS)


# ---- two models, one server ----


@pytest.mark.slow
def test_two_models_each_answer_as_they_would_alone(qwen, llama):
    """A Qwen3 at tp 2 and a Llama at tp 1 in one server, asked at once: each one's greedy tokens and
    logprobs equal that model served alone."""
    expected = {"qwen": [alone(qwen, p, tp=2) for p in PROMPTS], "llama": [alone(llama, p) for p in PROMPTS]}
    host = ModelHost([spec("qwen", qwen, tp=2), spec("llama", llama)], defaults=DEFAULTS)
    with LiveServer(host) as server:
        server.wait_ready()
        got: dict[tuple[str, int], tuple] = {}

        def ask(name: str, i: int) -> None:
            for _ in range(3):  # several times each, all at once
                got[name, i] = greedy(server, name, PROMPTS[i])

        threads = [threading.Thread(target=ask, args=(n, i)) for n in expected for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for name, outs in expected.items():
            for i, (tokens, logprobs) in enumerate(outs):
                assert got[name, i][0] == tokens
                assert got[name, i][1] == pytest.approx(logprobs, abs=1e-4)
        r = httpx.post(f"{server.base_url}/completions", json={"model": "gpt-9", "prompt": "hi"})
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "the model `gpt-9` does not exist; this server serves `qwen`, `llama`"
        listed = {m["id"]: m for m in httpx.get(f"{server.base_url}/models").json()["data"]}
        assert {n: (m["status"], m["tp"], len(m["devices"])) for n, m in listed.items()} == \
            {"qwen": ("ready", 2, 2), "llama": ("ready", 1, 1)}
        assert all(m["weight_bytes"] > 0 for m in listed.values())
        body = httpx.get(f"{server.url}/health").json()
        assert body["status"] == "ready"
        assert {n: m["status"] for n, m in body["models"].items()} == {"qwen": "ready", "llama": "ready"}
        for name, ranks in (("qwen", 2), ("llama", 1)):  # each model's ranks: weights, KV cache, resident bytes
            memory = body["models"][name]["memory"]
            assert len(memory) == ranks and all(r["weight_bytes"] > 0 and r["kv_bytes"] > 0 for r in memory)
            assert sum(r["weight_bytes"] for r in memory) == listed[name]["weight_bytes"]
        text = httpx.get(f"{server.url}/metrics").text
        assert 'neuron_generation_tokens_total{model="qwen"}' in text and \
            'neuron_generation_tokens_total{model="llama"}' in text


def test_placement_keeps_gpus_to_one_model_unless_a_spec_shares():
    from types import SimpleNamespace

    from neuron.engine.host_memory import PlacementError, place

    def model(devices, tp=2):
        return SimpleNamespace(spec=SimpleNamespace(devices=devices, tp=tp), device="cuda:0")

    assert place(model(["cuda:2", "cuda:3"]), {"cuda:0"}, share=False) == ["cuda:2", "cuda:3"]
    with pytest.raises(PlacementError, match=r"device\(s\) cuda:1 belong to another model"):
        place(model(["cuda:0", "cuda:1"]), {"cuda:1"}, share=False)
    assert place(model(["cuda:0", "cuda:1"]), {"cuda:1"}, share=True) == ["cuda:0", "cuda:1"]
    cpu = SimpleNamespace(spec=SimpleNamespace(devices=None, tp=2), device="cpu")
    assert place(cpu, {"cuda:0"}, share=False) == ["cpu", "cpu"]  # models share the cores


# ---- the admin API ----


def test_the_admin_api_is_off_without_a_key_and_guarded_with_one(default_tokenizer):
    from server_harness import ScriptedEngine, scripted_engine

    with LiveServer(scripted_engine(ScriptedEngine(default_tokenizer, {}))) as server:
        assert admin(server, "GET", "/admin/models").status_code == 404
    with LiveServer(scripted_engine(ScriptedEngine(default_tokenizer, {})),
                    ServerConfig(admin_key=ADMIN, api_key="user-key")) as server:
        server.wait_ready(10)
        assert admin(server, "GET", "/admin/models", key=None).status_code == 401
        assert admin(server, "GET", "/admin/models", key="user-key").status_code == 401  # not the API key
        r = admin(server, "GET", "/admin/models")
        assert r.status_code == 200 and [m["name"] for m in r.json()["data"]] == ["stub"]
        assert httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 401
        assert admin(server, "DELETE", "/admin/models/nothing").status_code == 404


@pytest.mark.slow
def test_load_list_unload_through_the_api_and_the_command(qwen, llama, capsys):
    host = ModelHost([spec("qwen", qwen)], defaults=DEFAULTS)
    with LiveServer(host, ServerConfig(admin_key=ADMIN)) as server:
        server.wait_ready()
        r = admin(server, "POST", "/admin/models", json={"name": "llama", "model": str(llama)})
        assert r.status_code == 201 and r.json()["status"] == "ready", r.text
        assert greedy(server, "llama", PROMPTS[0])[0] == alone(llama, PROMPTS[0])[0]
        dup = admin(server, "POST", "/admin/models", json={"name": "llama", "model": str(llama)})
        assert dup.status_code == 409 and dup.json()["error"]["code"] == "model_exists"
        bad = admin(server, "POST", "/admin/models", json={"name": "x", "model": str(qwen), "tp": 3})
        assert bad.status_code == 400 and "sizes that do: 1, 2, 4" in bad.json()["error"]["message"]
        missing = admin(server, "POST", "/admin/models", json={"name": "y", "model": "/no/such/model"})
        assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
        workers = procfs.child_pids(os.getpid())
        for body, says in (({"quantization": "q3"}, "quantization"), ({"devices": ["cuda:7"]}, "device cuda:7"),
                           ({"devices": ["tpu"]}, "device must be cpu, cuda or cuda:N"),
                           ({"gpus": [0]}, "unknown key(s) 'gpus'")):
            r = admin(server, "POST", "/admin/models", json={"name": "z", "model": str(qwen), **body})
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert procfs.child_pids(os.getpid()) == workers  # each refused before any worker started
        assert [m["name"] for m in admin(server, "GET", "/admin/models").json()["data"]] == ["qwen", "llama"]

        assert run_command(["models", "list", "--url", server.url, "--admin-key", ADMIN]) == 0
        out = capsys.readouterr().out
        assert "qwen\tready\ttp=1" in out and "llama\tready\ttp=1" in out
        assert run_command(["models", "unload", "--url", server.url, "--admin-key", ADMIN, "llama"]) == 0
        assert [m["id"] for m in httpx.get(f"{server.base_url}/models").json()["data"]] == ["qwen"]
        r = httpx.post(f"{server.base_url}/completions", json={"model": "llama", "prompt": [1, 2]})
        assert r.status_code == 404
        assert run_command(["models", "load", "--url", server.url, "--admin-key", ADMIN, "--name", "llama2",
                            "--model", str(llama)]) == 0
        assert greedy(server, "llama2", PROMPTS[1])[0] == alone(llama, PROMPTS[1])[0]
        assert run_command(["models", "unload", "--url", server.url, "--admin-key", "wrong", "llama2"]) == 1
        assert "401" in capsys.readouterr().err


@pytest.mark.slow
def test_a_model_that_fails_in_its_workers_leaves_nothing_behind_and_the_others_serve(qwen, llama, tmp_path):
    """A checkpoint whose final norm holds NaN passes the pre-flight and fails in its ranks: the load
    answers with the cause, its workers are gone, it holds no memory, and llama serves on."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(qwen, bad)
    weights = next(bad.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    host = ModelHost([spec("llama", llama)], defaults=DEFAULTS)
    with LiveServer(host, ServerConfig(admin_key=ADMIN)) as server:
        server.wait_ready()
        expected = greedy(server, "llama", PROMPTS[0])
        before = procfs.child_pids(os.getpid())
        r = admin(server, "POST", "/admin/models", json={"name": "bad", "model": str(bad), "tp": 2})
        assert r.status_code >= 400 and "model.norm.weight" in r.json()["error"]["message"], r.text
        assert "bad" not in host.models and "bad" not in host.ledger.held
        wait_until(lambda: procfs.child_pids(os.getpid()) == before, 10, "the failed model's workers stayed")
        assert greedy(server, "llama", PROMPTS[0]) == expected


# ---- on demand, keep_alive, memory ----


@pytest.mark.slow
def test_an_on_demand_model_loads_at_its_first_request_and_keep_alive_unloads_it(qwen, llama):
    host = ModelHost([spec("qwen", qwen), spec("llama", llama, load="on_demand", keep_alive=1)], defaults=DEFAULTS)
    with LiveServer(host, ServerConfig(admin_key=ADMIN)) as server:
        server.wait_ready()  # the start-up model alone
        assert host.models["llama"].status == "available" and host.models["llama"].engine is None
        assert greedy(server, "llama", PROMPTS[0])[0] == alone(llama, PROMPTS[0])[0]  # waits for the load
        assert host.models["llama"].status == "ready"
        wait_until(lambda: host.models["llama"].status == "available", 10, "keep_alive did not unload the model")
        assert host.models["qwen"].status == "ready"  # start-up models stay
        assert greedy(server, "llama", PROMPTS[1])[0] == alone(llama, PROMPTS[1])[0]  # and it loads again


def test_requests_queued_behind_an_on_demand_load_get_503_after_the_load_timeout(qwen, default_tokenizer):
    """A load slower than --load-timeout-s: the requests waiting on it get 503 with Retry-After, and
    the model serves once loaded."""
    from server_harness import ScriptedEngine

    from neuron.engine.async_engine import AsyncEngine

    def slow(model, spec) -> AsyncEngine:
        def load():
            time.sleep(2.0)
            return ScriptedEngine(default_tokenizer, {"": ["hi"]})
        return AsyncEngine(load, model_name=spec.name, max_running=4, max_waiting=4)

    host = ModelHost([spec("m", qwen, load="on_demand")], defaults=DEFAULTS, load_timeout_s=0.5, make_engine=slow)
    with LiveServer(host) as server:
        t0 = time.monotonic()
        r = httpx.post(f"{server.base_url}/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and "Retry-After" in r.headers and 0.5 <= time.monotonic() - t0 < 2.0, r.text
        wait_until(lambda: host.models["m"].status == "ready", 10, "the load did not finish")
        r = httpx.post(f"{server.base_url}/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200, r.text


@pytest.mark.slow
def test_a_load_past_the_memory_budget_evicts_idle_models_or_is_refused_with_the_sizes(qwen, llama):
    from neuron.engine.host_memory import MemoryLedger, _plans
    from neuron.engine.model_config import resolve_model_config

    need = {n: _plans(resolve_model_config(s.engine))[0].total for n, s in
            (("qwen", spec("qwen", qwen)), ("llama", spec("llama", llama)))}
    budget = max(need.values()) + min(need.values()) // 2  # one of them fits, not both
    specs = [spec("qwen", qwen, load="on_demand"), spec("llama", llama, load="on_demand")]
    host = ModelHost(specs, defaults=DEFAULTS, memory_budget=budget)
    assert isinstance(host.ledger, MemoryLedger)
    with LiveServer(host, ServerConfig(admin_key=ADMIN)) as server:
        greedy(server, "qwen", PROMPTS[0])
        greedy(server, "llama", PROMPTS[0])  # qwen, idle, is unloaded to make room
        assert (host.models["qwen"].status, host.models["llama"].status) == ("available", "ready")
        before = procfs.child_pids(os.getpid())
        # a KV cache asked for by size is not lowered to fit; unloading llama would not make room either
        r = admin(server, "POST", "/admin/models", json={"name": "big", "model": str(qwen),
                                                           "kv_cache_memory": budget})
        assert r.status_code == 507, r.text
        message = r.json()["error"]["message"]
        assert "model `big` does not fit: cpu needs" in message and "GiB left" in message and "llama" in message
        assert procfs.child_pids(os.getpid()) == before  # nothing started
        assert "big" not in host.models
        assert host.models["llama"].status == "ready"  # not unloaded for nothing
        # one that fits once llama goes: llama (idle, on demand) is unloaded and it loads
        r = admin(server, "POST", "/admin/models", json={"name": "next", "model": str(qwen)})
        assert r.status_code == 201, r.text
        assert (host.models["llama"].status, host.models["next"].status) == ("available", "ready")


# ---- isolation ----


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_failed_rank_of_one_model_leaves_the_others_stream_unbroken(qwen, llama, sig):
    """A rank of qwen killed (or frozen) while llama streams: llama's stream has no gap of a second,
    qwen recovers by itself, and can be unloaded and loaded again."""
    host = ModelHost([spec("qwen", qwen, tp=2), spec("llama", llama)], defaults=DEFAULTS)
    with LiveServer(host, ServerConfig(admin_key=ADMIN)) as server:
        server.wait_ready()
        gaps, stop = [], threading.Event()

        def streams() -> None:  # llama streams, one request after another, until qwen is back
            last = time.monotonic()
            while not stop.is_set():
                for _ in client(server).completions.create(model="llama", prompt=[1, 2, 3], max_tokens=100,
                                                           temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

        t = threading.Thread(target=streams)
        t.start()
        try:
            wait_until(lambda: len(gaps) > 5, 30)
            victim = host.models["qwen"].engine.engine.executor.pool.workers[0].proc.pid
            os.kill(victim, sig)
            killed_at = len(gaps)
            wait_until(lambda: host.models["qwen"].status == "recovering", 30, "qwen's failure went unnoticed")
            wait_until(lambda: host.models["qwen"].status == "ready", 60, "qwen did not recover")
            assert gone(victim)
        finally:
            stop.set()
            t.join(60)
        during = gaps[killed_at:]
        assert len(during) > 20 and max(gaps[1:]) < 1.0, (len(during), max(gaps[1:]))
        print(f"{signal.Signals(sig).name}: {len(during)} llama tokens while qwen failed and recovered, "
              f"longest gap {max(gaps[1:]) * 1000:.0f} ms")
        expected = alone(qwen, PROMPTS[0], tp=2)[0]
        assert greedy(server, "qwen", PROMPTS[0])[0] == expected
        assert admin(server, "DELETE", "/admin/models/qwen").status_code == 200
        r = admin(server, "POST", "/admin/models", json={"name": "qwen", "model": str(qwen), "tp": 2})
        assert r.status_code == 201, r.text
        assert greedy(server, "qwen", PROMPTS[0])[0] == expected


@pytest.mark.slow
def test_unloading_with_drain_lets_short_streams_finish_and_aborts_the_rest(tmp_path):
    qwen = build_checkpoint(tmp_path, seed=5, max_position_embeddings=8192)  # room for a stream that outlasts the drain
    host = ModelHost([spec("qwen", qwen, max_num_seqs=4, max_model_len=8192)], defaults=DEFAULTS)
    with LiveServer(host, ServerConfig(admin_key=ADMIN)) as server:
        server.wait_ready()
        results: dict[str, list] = {}

        def stream(key: str, tokens: int) -> None:
            events = []
            with httpx.stream("POST", f"{server.base_url}/completions", timeout=120,
                              json={"model": "qwen", "prompt": [1, 2, 3], "max_tokens": tokens, "stream": True,
                                    "ignore_eos": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
            results[key] = events

        short = threading.Thread(target=stream, args=("short", 8))
        long = threading.Thread(target=stream, args=("long", 8000))
        long.start()
        short.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        r = admin(server, "DELETE", "/admin/models/qwen", params={"drain": "0.5"})
        assert r.status_code == 200 and time.monotonic() - t0 < 10
        short.join(30)
        long.join(30)
        assert results["short"][-1]["choices"][0]["finish_reason"] == "length"
        last = results["long"]
        assert last[-2]["choices"][0]["finish_reason"] == "abort" and last[-1]["error"]["code"] == "model_unloaded"
        assert host.models == {}


@pytest.mark.slow
def test_load_unload_cycles_leak_no_process_descriptor_or_memory(qwen):
    """10 loads and unloads: the workers are gone each time, and the leader's open descriptors and
    RSS end where they started (RSS within 50 MB, 5 MB a cycle)."""
    host = ModelHost([], defaults=DEFAULTS)
    with LiveServer(host, ServerConfig(admin_key=ADMIN)) as server:
        def cycle() -> None:
            r = admin(server, "POST", "/admin/models", json={"name": "m", "model": str(qwen), "tp": 2})
            assert r.status_code == 201, r.text
            workers = [w.proc.pid for w in host.models["m"].engine.engine.executor.pool.workers]
            assert workers and set(workers) <= set(procfs.child_pids(os.getpid()))
            assert admin(server, "DELETE", "/admin/models/m").status_code == 200
            assert all(gone(pid) for pid in workers)

        cycle()  # the first load builds kernels and warms caches
        gc.collect()  # what earlier tests left for the collector closes now, not during the cycles
        fds, rss = len(os.listdir("/proc/self/fd")), _rss()
        for _ in range(10):
            cycle()
        gc.collect()
        print(f"10 cycles: descriptors {fds} -> {len(os.listdir('/proc/self/fd'))}, "
              f"RSS {rss / 2**20:.0f} -> {_rss() / 2**20:.0f} MiB")
        assert len(os.listdir("/proc/self/fd")) == fds
        assert _rss() - rss < 50 * 2**20


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


# ---- neuron serve with several models ----


@pytest.mark.slow
def test_neuron_serve_takes_several_models_and_a_models_file(qwen, llama, tmp_path):
    models = tmp_path / "models.yaml"
    models.write_text(f"- {{name: llama, model: {llama}, load: on_demand}}\n")
    with ServeProcess(str(qwen), "--models", str(models), "--device", "cpu", "--dtype", "float32",
                      "--max-model-len", "128", env={"NEURON_ADMIN_KEY": ADMIN}) as served:
        listed = {m["id"]: m["status"] for m in httpx.get(f"{served.base_url}/models").json()["data"]}
        assert listed == {str(qwen): "ready", "llama": "available"}
        assert greedy(served, "llama", PROMPTS[0])[0] == alone(llama, PROMPTS[0])[0]
        assert any("ready: serving" in line and "`llama`" in line for line in served.lines)


# ---- on a GPU ----


@pytest.mark.gpu
def test_two_models_share_one_gpu_each_with_its_fraction_and_an_unload_gives_it_back(qwen):
    """Two models on cuda:0, the second with share_devices: each sizes its KV cache from its own
    fraction; a third without share_devices is refused; unloading the second gives its memory back
    (mem_get_info within 1 % of the device)."""
    import dataclasses

    import torch

    gpu = dataclasses.replace(DEFAULTS, device="cuda")
    total = torch.cuda.mem_get_info(0)[1]
    a = ModelSpec.parse({"name": "a", "model": str(qwen), "devices": [0], "gpu_memory_utilization": 0.3}, gpu, "t")
    host = ModelHost([a], defaults=gpu)
    with LiveServer(host, ServerConfig(admin_key=ADMIN)) as server:
        server.wait_ready()
        expected = greedy(server, "a", PROMPTS[0])
        before = torch.cuda.mem_get_info(0)[0]
        r = admin(server, "POST", "/admin/models", json={"name": "b", "model": str(qwen), "devices": [0],
                                                           "share_devices": True, "gpu_memory_utilization": 0.3})
        assert r.status_code == 201, r.text
        blocks = {n: host.models[n].engine.engine.executor.num_kv_blocks for n in ("a", "b")}
        assert abs(blocks["a"] - blocks["b"]) <= 0.02 * blocks["a"], blocks  # b's share is not a's left-over
        assert greedy(server, "b", PROMPTS[0])[0] == expected[0]
        taken = admin(server, "POST", "/admin/models", json={"name": "c", "model": str(qwen), "devices": [0]})
        assert taken.status_code == 409 and taken.json()["error"]["code"] == "devices_taken"
        assert admin(server, "DELETE", "/admin/models/b").status_code == 200
        after = torch.cuda.mem_get_info(0)[0]
        assert abs(after - before) <= 0.01 * total, (before, after)
        assert greedy(server, "a", PROMPTS[0]) == expected


# ---- keep_alive's loop ----


class _IdleEngine:
    """What the keep_alive loop reads of a loaded engine; `stop` fails where asked."""

    def __init__(self, fail_stop: bool = False):
        from neuron.engine.async_engine import EngineState

        self.state, self.open_streams, self.error, self.fail_stop = EngineState.READY, [], None, fail_stop
        self.metrics = type("M", (), {"forget": lambda self: None})()
        self.stopped = False

    def start(self) -> None:
        pass

    async def drain(self, grace_s: float, **kw) -> int:
        return 0

    def stop(self) -> None:
        self.stopped = True
        if self.fail_stop:
            raise RuntimeError("a rank would not die")


async def test_the_keep_alive_loop_outlives_a_model_whose_stop_fails(monkeypatch, caplog):
    """A model whose engine fails to stop is let go and logged; the loop goes on and unloads the
    next idle model, and the memory ledger forgets both."""
    from neuron.engine import host as host_module

    monkeypatch.setattr(host_module, "_REAP_INTERVAL_S", 0.05)
    monkeypatch.setattr(host_module, "_MIN_IDLE_S", 0.05)
    host = ModelHost([spec("a", "/m", load="on_demand", keep_alive=0), spec("b", "/m", load="on_demand",
                                                                             keep_alive=0)], defaults=DEFAULTS)
    engines = {"a": _IdleEngine(fail_stop=True), "b": _IdleEngine()}
    for name, engine in engines.items():
        host.models[name].engine = engine
        host.ledger.held[name] = {"cpu": 1 << 20}
    host.models["a"].last_used -= 1  # the older: unloaded first
    host.start()
    try:
        deadline = time.monotonic() + 30  # each unload collects garbage: slow in a process that ran models
        while time.monotonic() < deadline and (host.ledger.held or any(m.unloading for m in host.models.values())):
            await asyncio.sleep(0.05)
        assert engines["a"].stopped and engines["b"].stopped
        assert [m.status for m in host.models.values()] == ["available", "available"]
        assert host.ledger.held == {} and not host._reaper.done()
        assert "model `a` did not stop cleanly" in caplog.text
    finally:
        host._stopping = True
        host._reaper.cancel()
