"""Finding checkpoints, reading only this rank's slices, and refusing what neuron cannot run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from neuron.errors import ConfigError, ModelNotFound, UnsupportedModel
from neuron.layers.tensor_parallel import Shard
from neuron.models.loader import CheckpointReader, resolve_model_path, safetensors_files
from neuron.models.qwen3 import Qwen3Config


def _fake_cache(root, repo: str, commit: str = "abc123"):
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    (snap / "config.json").write_text("{}")
    return snap


def test_local_directory_wins(tmp_path):
    assert resolve_model_path(str(tmp_path)) == tmp_path.resolve()


def test_repo_id_precedence(tmp_path, monkeypatch):
    explicit, hub_cache, hf_home = tmp_path / "explicit", tmp_path / "hubcache", tmp_path / "home"
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HOME", str(hf_home))
    snap_home = _fake_cache(hf_home / "hub", "org/m", "c1")
    assert resolve_model_path("org/m") == snap_home
    snap_hub = _fake_cache(hub_cache, "org/m", "c2")
    assert resolve_model_path("org/m") == snap_hub
    snap_explicit = _fake_cache(explicit, "org/m", "c3")
    assert resolve_model_path("org/m", cache_dir=str(explicit)) == snap_explicit
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HF_HOME")
    snap_default = _fake_cache(tmp_path / "user" / ".cache" / "huggingface" / "hub", "org/m", "c4")
    assert resolve_model_path("org/m") == snap_default


def test_missing_repo_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-such-home"))
    with pytest.raises(ModelNotFound) as err:
        resolve_model_path("org/absent")
    message = str(err.value)
    assert f"(looked in: {tmp_path}" in message and "no-such-home" not in message  # caches that exist only
    assert message.endswith("fetch it first with `hf download org/absent`, or pass a local path.")


@pytest.mark.parametrize("path", ["/tmp/does-not-exist", "./missing", "../missing", "~/missing", "a/b/c"])
def test_a_missing_local_path_is_said_to_be_missing(path):
    with pytest.raises(ModelNotFound, match=f"^model path {path} does not exist$"):
        resolve_model_path(path)


def test_sharded_index_and_slices(tmp_path):
    a = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    b = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    save_file({"a": a}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": b}, tmp_path / "model-00002-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "stray.safetensors").write_bytes(b"")  # not in the index: ignored
    files = safetensors_files(tmp_path)
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    with CheckpointReader(files) as r:
        assert torch.equal(r.read("a", 0, 2, 4), a[2:4])
        assert torch.equal(r.read("b", 1, 1, 3), b[:, 1:3])
        assert torch.equal(r.read("b"), b)
        with pytest.raises(ConfigError, match="missing"):
            r.read("c")


def test_index_naming_missing_file(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ConfigError, match="missing"):
        safetensors_files(tmp_path)


def test_vocab_shards_cover_odd_vocab():
    for world in (2, 3, 4):
        ranges = [Shard(r, world).padded(301)[:2] for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == 301
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_rope_parameters_are_read_from_either_place():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ConfigError, match="rope type 'dynamic'"):
        Qwen3Config.from_dict({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    assert Qwen3Config.from_dict({**base, "rope_theta": 5.0}).rope.theta == 5.0
    new = Qwen3Config.from_dict({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 7.0},
                                 "max_position_embeddings": 64}).rope
    assert (new.rope_type, new.theta, new.factor, new.original_max_position_embeddings) == ("yarn", 7.0, 4.0, 64)
    legacy = Qwen3Config.from_dict({**base, "rope_theta": 3.0, "rope_scaling": {"type": "linear", "factor": 2.0}}).rope
    assert (legacy.rope_type, legacy.theta, legacy.factor) == ("linear", 3.0, 2.0)


def test_unsupported_model_type_fails_before_workers(tmp_path, monkeypatch):
    """No worker may be spawned for a checkpoint that cannot run: the error names what is supported."""
    import subprocess

    from neuron import LLM

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    spawned = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: spawned.append(a))
    with pytest.raises(UnsupportedModel, match="supported types: qwen3"):
        LLM(str(tmp_path), tensor_parallel_size=2, device="cpu")
    assert spawned == []


@pytest.mark.slow
def test_per_rank_weights_are_about_one_over_tp(odd_checkpoint):
    from checkpoints import executor_config

    from neuron.executor.executor import Executor

    sizes = {}
    for tp in (1, 2):
        executor = Executor(executor_config(odd_checkpoint, tp=tp, max_num_seqs=1, max_model_len=64))
        executor.start()
        try:
            sizes[tp] = executor.weight_bytes
        finally:
            executor.shutdown()
    full = sizes[1][0]
    for b in sizes[2]:
        assert 0.45 * full < b < 0.62 * full  # norms are replicated, so a little over half


def test_default_checkpoint_copy_keeps_working(tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_CACHE_DIR", str(tmp_path / "cache"))
    from neuron.utils.default_checkpoint import default_model_dir

    src = default_model_dir()
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    assert resolve_model_path(str(dst)) == dst.resolve()
