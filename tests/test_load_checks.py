"""What is checked about a model before and while it loads, apart from hostile files
(tests/test_hostile_files.py): the load's deadline and its phase, the memory plan against the
host, the tensor-parallel sizes a model splits into, and the bounds of the GGUF walk."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from checkpoints import BASE, build_checkpoint
from hostile_files import STRING, U32, gguf_file, gguf_meta, gguf_tensors, kv

from neuron import LLM
from neuron.engine.loading import LoadTimeout, load_within
from neuron.errors import ConfigError
from neuron.models import valid_tp_sizes
from neuron.models.gguf_layout import read_layout
from neuron.models.memory_plan import MemoryPlan, check_fits, kv_bytes_per_token


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("base"))


def test_a_load_past_its_deadline_fails_naming_its_phase(base, monkeypatch):
    from neuron.engine import model_config

    def stuck(*args):
        time.sleep(5)
        return None, None

    monkeypatch.setattr(model_config, "_tokenizer", stuck)
    monkeypatch.setenv("NEURON_LOAD_TIMEOUT_S", "0.5")
    t0 = time.monotonic()
    with pytest.raises(LoadTimeout, match=r"within 0.5 s .*building the tokenizer"):
        LLM(str(base))
    assert time.monotonic() - t0 < 2


def test_a_load_that_finishes_late_is_closed_and_errors_pass_through():
    closed, interrupted = [], []

    def slow(phases):
        phases("reading a slow file")
        time.sleep(0.3)
        return "engine"

    with pytest.raises(LoadTimeout, match="reading a slow file"):
        load_within(slow, 0.05, interrupted.append, close=closed.append)
    assert interrupted and "reading a slow file" in interrupted[0]
    deadline = time.monotonic() + 2
    while not closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closed == ["engine"]

    def broken(phases):
        raise ConfigError("bad file")

    with pytest.raises(ConfigError, match="bad file"):
        load_within(broken, 5)


def test_the_loading_thread_outlives_what_it_started():
    """Workers die with the thread that spawned them (PR_SET_PDEATHSIG): it waits for the shutdown."""
    released, threads = threading.Event(), []

    def load(phases):
        threads.append(threading.current_thread())
        return "engine"

    assert load_within(load, 5, hold=lambda engine: released.wait()) == "engine"
    time.sleep(0.05)
    assert threads[0].is_alive()
    released.set()
    threads[0].join(2)
    assert not threads[0].is_alive()


def test_a_plan_past_the_host_memory_is_refused_with_its_sizes():
    plan = MemoryPlan(weights=3 * 2**30, kv_cache=8 * 2**30, tables=2**30)
    check_fits(plan, 1, 20 * 2**30, "fix")
    with pytest.raises(ConfigError, match=r"12.00 GiB per rank .*KV cache 8.00.* x 2 rank\(s\) .* = 24.00 GiB.*"
                                          r"16.00 GiB available; lower it"):
        check_fits(plan, 2, 16 * 2**30, "lower it")


def test_kv_bytes_per_token_follow_the_config():
    # 2 layers x K and V x (2 KV heads / tp) x 16 dims x 4 bytes
    assert kv_bytes_per_token(dict(BASE, model_type="qwen3"), 1, 4) == 2 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token(dict(BASE, model_type="qwen3"), 4, 4) == 2 * 2 * 1 * 16 * 4  # a KV head per rank


def test_the_cpu_kv_cache_is_lowered_to_what_memory_holds(base, monkeypatch, caplog):
    """Room for max_num_seqs full-length sequences is the CPU default; a host that cannot hold it
    gets fewer, with a warning, and never fewer than one."""
    from neuron.executor import executor

    per_token = kv_bytes_per_token(dict(BASE, model_type="qwen3"), 1, 4)
    tables = 2 * 512 * 16 * 4
    weights = sum(f.stat().st_size for f in base.glob("*.safetensors"))  # fp32 already, so held as stored
    fake = int((weights + tables + 3.5 * 512 * per_token) / 0.9) + 1
    monkeypatch.setattr(executor, "available_bytes", lambda: fake)
    caplog.set_level(logging.WARNING, logger="neuron")
    with LLM(str(base), max_num_seqs=8) as llm:
        assert llm.engine.executor.num_kv_blocks == 56 * 2  # 3.5 sequences of 32 blocks: what the room holds
    assert "holds 3 sequences of max_model_len 512 per rank, not the 8" in caplog.text
    monkeypatch.setattr(executor, "available_bytes", lambda: int((weights + tables + 0.5 * 512 * per_token) / 0.9))
    with pytest.raises(ConfigError, match="not enough memory"):
        LLM(str(base))


def test_valid_tp_sizes_are_those_every_split_allows():
    assert valid_tp_sizes(dict(BASE, model_type="qwen3")) == [1, 2, 4]  # 4 heads, 2 KV heads, width 128
    assert valid_tp_sizes(dict(BASE, model_type="qwen3", num_attention_heads=6, num_key_value_heads=6,
                               head_dim=8, intermediate_size=96), up_to=12) == [1, 2, 3, 6]


def test_the_gguf_walk_accepts_a_well_formed_file_and_bounds_every_count(base, tmp_path):
    import json

    config = json.loads((base / "config.json").read_text())
    tensors = gguf_tensors(base)
    good = gguf_file(tmp_path / "good.gguf", gguf_meta(config), tensors)
    read_layout(good)
    long_name = gguf_file(tmp_path / "name.gguf", gguf_meta(config) + [kv("general.name", STRING, "x" * (1 << 17))],
                          tensors)
    read_layout(long_name)  # a long string value is fine; a key of that length is not
    long_key = gguf_file(tmp_path / "key.gguf", gguf_meta(config) + [kv("k" * (1 << 17), U32, 1)], tensors)
    with pytest.raises(ConfigError, match=r"key\.gguf: a metadata key claims 131072 bytes \(at most 65536\)"):
        read_layout(long_key)


@pytest.mark.parametrize("tied", [False, True])
def test_the_memory_plan_counts_the_weights_a_rank_holds(tmp_path, tied):
    """Dense, int8 at load (its LM head quantized too) and fp8 (its head dense): the plan's weights
    are the rank's own count within 3 %. A tied head shares the embedding's table, held once,
    unless int8 makes it a quantized copy."""
    import json

    from neuron.layers.quantized import QuantizedWeight
    from neuron.models.memory_plan import plan

    path = build_checkpoint(tmp_path, seed=1, tie_word_embeddings=tied)
    config = json.loads((path / "config.json").read_text())
    for method in ("", "int8", "fp8"):
        with LLM(str(path), device="cpu", dtype="float32", quantization=method or None) as llm:
            model = llm.engine.executor.rank0.models["model"].model
            held = llm.engine.executor.weight_bytes[0]
            assert isinstance(model.lm_head.weight, QuantizedWeight) == (method == "int8")
            assert (model.lm_head.weight is model.embed.weight) == (tied and method != "int8")
        wanted = plan(config, [path / "model.safetensors"], tp=1, dtype_bytes=4, quantization=method,
                      max_model_len=64, kv_tokens=0, kv_cache_bytes=0).weights
        assert abs(wanted / held - 1) < 0.03, (method, wanted, held)
