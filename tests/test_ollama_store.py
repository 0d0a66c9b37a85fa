"""Models in Ollama's local store served by their Ollama names (neuron/models/ollama_store.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import httpx
import pytest
from checkpoints import model_config
from gguf_files import write_gguf

from neuron import LLM, SamplingParams
from neuron.errors import ConfigError, ModelNotFound
from neuron.models.loader import resolve_model_path
from neuron.models.ollama_store import find_model, parse_name


def _manifest(layers: list[dict]) -> dict:
    return {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                       "digest": "sha256:" + "0" * 64, "size": 2}, "layers": layers}


def _layer(store: Path, kind: str, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    (store / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"mediaType": f"application/vnd.ollama.image.{kind}", "digest": f"sha256:{digest}", "size": len(data)}


def _pull(store: Path, name: str, blob: Path | None, extra: list[dict] = (), tag: str = "latest",
          namespace: str = "library", params: dict | None = None) -> str:
    """`blob` (a GGUF file) into `store` as Ollama lays out a pulled model: the blob by its digest, a
    manifest naming it, a template layer and `params` as its parameters layer."""
    layers = []
    if blob is not None:
        layers.append(_layer(store, "model", blob.read_bytes()))
    if params is not None:
        layers.append(_layer(store, "params", json.dumps(params).encode()))
    layers += [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64, "size": 3},
               *extra]
    manifest = store / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps(_manifest(layers)))
    return manifest


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    from neuron.utils.default_checkpoint import default_model_dir

    return write_gguf(default_model_dir(), tmp_path_factory.mktemp("ollama-src") / "model.gguf", "Q8_0")


@pytest.mark.parametrize("name, parsed", [
    ("llama3.2", ("registry.ollama.ai", "library", "llama3.2", "latest")),
    ("llama3.2:1b", ("registry.ollama.ai", "library", "llama3.2", "1b")),
    ("huihui_ai/qwen3-abliterated:0.6b", ("registry.ollama.ai", "huihui_ai", "qwen3-abliterated", "0.6b")),
    ("hf.co/bartowski/SmolLM2-135M-GGUF:Q4_K_M", ("hf.co", "bartowski", "SmolLM2-135M-GGUF", "Q4_K_M")),
    ("../etc/passwd", None), ("a/../../b", None), ("a/b/c/d", None), ("", None), ("model:", None),
    ("/abs/path", None), ("name:../x", None), (".hidden", None),
])
def test_ollama_names_are_read_as_ollama_reads_them(name, parsed):
    assert parse_name(name) == parsed


def test_a_pulled_model_is_served_by_its_ollama_name(tmp_path, monkeypatch, gguf_file):
    store = tmp_path / "store"
    _pull(store, "tinychat", gguf_file, tag="q8")
    _pull(store, "tinychat", gguf_file)
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    blob = resolve_model_path("tinychat")
    assert blob.parent == store.resolve() / "blobs" and blob.name.startswith("sha256-")
    for name in ("tinychat:q8", "library/tinychat:latest", "registry.ollama.ai/library/tinychat"):
        assert resolve_model_path(name) == blob
    prompt = [[5, 17, 200, 3]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM("tinychat:q8", device="cpu", dtype="float32") as llm:
        assert llm.engine.model_name == "tinychat:q8"
        got = llm.generate(prompt, params)[0].outputs[0].token_ids
        assert llm.get_tokenizer().chat_template  # the file's own
    with LLM(str(gguf_file), device="cpu", dtype="float32") as llm:
        assert got == llm.generate(prompt, params)[0].outputs[0].token_ids


def test_what_the_store_cannot_give_is_refused_by_name(tmp_path, monkeypatch, gguf_file):
    store = tmp_path / "store"
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    with pytest.raises(ModelNotFound, match=r"neither a local path nor a model in Ollama's store \(none on this "
                                            r"machine\)\. .*`ollama pull absent:7b`"):
        resolve_model_path("absent:7b")
    _pull(store, "styled", gguf_file, extra=[{"mediaType": "application/vnd.ollama.image.adapter",
                                              "digest": "sha256:" + "2" * 64, "size": 9}])
    with pytest.raises(ConfigError, match="applies a LoRA adapter layer"):
        resolve_model_path("styled")
    manifest = _pull(store, "torn", gguf_file)
    shutil.rmtree(store / "blobs")
    with pytest.raises(ConfigError, match=r"its weights, blob sha256-[0-9a-f]{12}\.\.\., are missing"):
        resolve_model_path("torn")
    manifest.write_text(json.dumps(_manifest([{"mediaType": "application/vnd.ollama.image.model",
                                               "digest": "sha256:../../etc/passwd"}])))
    with pytest.raises(ConfigError, match="is not a sha256 digest"):
        resolve_model_path("torn")
    manifest.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be read"):
        resolve_model_path("torn")
    _pull(store, "templated", None)
    with pytest.raises(ConfigError, match="names 0 weight layers"):
        find_model("templated")
    manifest.write_text(" " * (2 << 20) + "{}")  # past what a manifest holds
    with pytest.raises(ConfigError, match="is larger than such a file is"):
        resolve_model_path("torn")
    _pull(store, "listed", gguf_file, params=["temperature", 0.6])
    with pytest.raises(ConfigError, match="its parameters layer is not a JSON object"):
        model_config("listed")


def test_an_ollama_models_parameters_are_its_sampling_defaults(tmp_path, monkeypatch, gguf_file):
    """Its parameters layer as generation_config.json's fields (Qwen3's temperature 0.6, top_k 20,
    ..., num_predict as the default max_tokens), and each stop word that is one of the vocabulary's
    added tokens a stop id."""
    store = tmp_path / "store"
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    _pull(store, "tuned", gguf_file, params={"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repeat_penalty": 1.1,
                                             "stop": ["<|im_start|>", "<|im_end|>", "User:"], "num_ctx": 4096,
                                             "num_predict": 300})
    cfg = model_config("tuned")
    assert cfg.sampling == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1,
                            "max_tokens": 300}
    start = cfg.tokenizer.added_token_id("<|im_start|>")
    assert start is not None and start in cfg.eos_token_ids and cfg.tokenizer.added_token_id("User:") is None
    _pull(store, "hot", gguf_file, params={"temperature": "hot"})
    with pytest.raises(ConfigError, match="the Ollama model's parameters: temperature must be"):
        model_config("hot")
    for unlimited in (-1, -2):  # Ollama's "no limit" and "fill the context"
        _pull(store, f"open{-unlimited}", gguf_file, params={"num_predict": unlimited})
        assert model_config(f"open{-unlimited}").sampling == {}
    _pull(store, "endless", gguf_file, params={"num_predict": 0.5})
    with pytest.raises(ConfigError, match="max_new_tokens must be"):
        model_config("endless")
    _pull(store, "plain", gguf_file)
    assert model_config("plain").sampling == {}


def test_the_store_is_served_on_demand_by_ollama_names(tmp_path, monkeypatch, gguf_file):
    """--ollama-store: every model of the store that neuron reads (library, namespaced and hf.co
    names alike) is a model of the server, loaded at its first request; one of an architecture
    neuron does not read, or with an adapter layer, is left out with its reason; a name the command
    line serves is its own."""
    import gguf
    import numpy as np
    from gguf_files import write_tensors
    from server_harness import LiveServer

    from neuron.engine.engine_config import EngineConfig
    from neuron.engine.host import ModelHost
    from neuron.engine.model_config import ollama_models
    from neuron.entrypoints import serve
    from neuron.entrypoints.cli import _parser
    from neuron.entrypoints.openai.app import ServerConfig
    from neuron.models.ollama_store import list_models

    store = tmp_path / "store"
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    _pull(store, "tiny", gguf_file, tag="0.6b")
    manifest = _pull(store, "tiny", gguf_file, tag="q8", namespace="me")
    hf = store / "manifests" / "hf.co" / "org" / "tiny-GGUF" / "Q8_0"
    hf.parent.mkdir(parents=True)
    shutil.copy(manifest, hf)
    gemma = write_tensors(tmp_path / "gemma.gguf", {"x": (np.zeros((2, 32), np.float32), gguf.GGMLQuantizationType.F32)},
                          "gemma3")
    _pull(store, "gemma3", gemma, tag="1b")
    _pull(store, "styled", gguf_file, extra=[{"mediaType": "application/vnd.ollama.image.adapter",
                                              "digest": "sha256:" + "2" * 64, "size": 9}])
    (store / "manifests" / "registry.ollama.ai" / "library" / "odd name").mkdir()  # not a name Ollama gives
    (store / "manifests" / "registry.ollama.ai" / "linked").symlink_to(tmp_path)  # no links out of the store
    assert list_models() == ["gemma3:1b", "hf.co/org/tiny-GGUF:Q8_0", "me/tiny:q8", "styled:latest", "tiny:0.6b"]
    served, skipped = ollama_models()
    assert served == ["hf.co/org/tiny-GGUF:Q8_0", "me/tiny:q8", "tiny:0.6b"]
    assert "'gemma3' is not one neuron reads" in skipped["gemma3:1b"]
    assert "LoRA adapter" in skipped["styled:latest"]

    args = _parser().parse_args(["serve", "--ollama-store", "tiny:0.6b", "--device", "cpu", "--dtype", "float32",
                                 "--max-model-len", "128"])
    engine, _ = serve.configs(args)
    specs = serve.model_specs(args, engine)
    assert [(s.name, s.load) for s in specs] == [("tiny:0.6b", "startup"), ("hf.co/org/tiny-GGUF:Q8_0", "on_demand"),
                                                 ("me/tiny:q8", "on_demand")]
    host = ModelHost(specs[1:], defaults=EngineConfig(device="cpu", dtype="float32", max_model_len=128))
    with LiveServer(host, ServerConfig()) as server:
        tags = httpx.get(f"{server.url}/api/tags").json()["models"]
        assert [(t["name"], t["status"]) for t in tags] == [("hf.co/org/tiny-GGUF:Q8_0", "available"),
                                                            ("me/tiny:q8", "available")]
        r = httpx.post(f"{server.url}/api/generate", json={"model": "me/tiny:q8", "prompt": "hi", "stream": False,
                                                           "options": {"num_predict": 3, "temperature": 0}},
                       timeout=120)
        assert r.status_code == 200 and r.json()["done"], r.text
        assert host.models["me/tiny:q8"].status == "ready" and host.models["hf.co/org/tiny-GGUF:Q8_0"].engine is None
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="--ollama-store: Ollama's store .* holds no model neuron reads"):
        serve.model_specs(_parser().parse_args(["serve", "--ollama-store"]), engine)
