"""The executor: one entry point per operation (rank 0 handles the very message the workers get),
and workers of another protocol version refused at start-up."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import pytest
from checkpoints import executor_config

from neuron.engine.llm_engine import EngineConfig, LLMEngine
from neuron.errors import ConfigError
from neuron.executor.executor import Executor
from neuron.rpc import protocol as p
from neuron.step import SeqStep

MOCK = Path(__file__).resolve().with_name("mock_worker.py")

pytestmark = pytest.mark.timeout(120)


def _mock(script: list[dict]):
    def cmd(rank: int, world_size: int, device: str) -> list[str]:
        return [sys.executable, str(MOCK), "--rank", str(rank), "--tp-size", str(world_size),
                "--script", json.dumps(script)]

    return cmd


def test_a_worker_of_another_protocol_version_is_refused_naming_both():
    stale = p.PROTOCOL_VERSION + 1
    executor = Executor(executor_config(tp=2, max_num_seqs=1, max_model_len=64),
                        worker_cmd=_mock([{"op": "ping", "action": "version", "protocol": stale}]))
    with pytest.raises(ConfigError) as info:
        executor.start()
    message = str(info.value)
    assert f"rank 1 speaks protocol version {stale}" in message
    assert f"this leader speaks {p.PROTOCOL_VERSION}" in message
    assert executor.pool.workers == []  # nothing left running


def test_rank0_handles_the_same_messages_as_the_workers():
    executor = Executor(executor_config(tp=2, max_num_seqs=2, max_model_len=64, block_size=16))
    seen: list[p.Message] = []
    execute = executor.rank0.execute
    executor.rank0.execute = lambda msg: (seen.append(msg), execute(msg))[1]
    executor.start()
    try:
        logits = executor.step([SeqStep(0, [1, 2, 3], 0, [0], True), SeqStep(1, [4], 0, [1], True)])
        executor.clear([0])
    finally:
        executor.shutdown()
    ops = [type(m).__name__ for m in seen]
    assert ops == ["Init", "CommSanityCheck", "CheckKernels", "LoadShard", "ForwardStep", "ClearKvCache"]
    step = seen[4]
    assert [(s.slot, s.token_ids, s.offset, s.new_blocks, s.fresh) for s in step.seqs] == [
        (0, [1, 2, 3], 0, [0], True), (1, [4], 0, [1], True)]
    assert tuple(logits.shape) == (2, executor.config["vocab_size"])


def test_the_load_log_calls_the_model_by_its_served_name(caplog):
    caplog.set_level(logging.INFO, logger="neuron")
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", served_model_name="tiny-chat", max_model_len=64,
                                    max_num_seqs=1)).start()
    engine.shutdown()
    lines = [r.getMessage() for r in caplog.records]
    assert any(re.fullmatch(r"model `tiny-chat` ready on tp=1 \(single\) in \d+ ms", line) for line in lines), lines
