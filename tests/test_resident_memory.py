"""One copy of the weights: each CPU rank's resident memory grows by its weights and KV cache, not
twice its weights, by the end of a prefill of many rows (which ran oneDNN on a packed copy of every
fp32 weight before), in fp32 and bf16; the executor reports both figures per rank."""

import pytest
from checkpoints import build_checkpoint, executor_config

from neuron.executor.executor import Executor
from neuron.step import SeqStep
from neuron.utils import procfs

# What a rank's process grows by besides its weights and KV cache over a load and a 512-token
# prefill: the kernels' libraries, oneDNN's JIT code and scratch memory, the step's activations
# and the allocator's free lists. Below the 69 MiB per rank of the fp32 weights' second copy.
SLACK = 48 * 2**20
# 6 layers of 1024 wide, 3072 in the MLP: 276 MB of fp32 weights, 138 per rank at tp 2
LARGE = dict(vocab_size=256, hidden_size=1024, intermediate_size=3072, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=2, head_dim=128, max_position_embeddings=1024)
PROMPT = 512


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("large"), **LARGE)


def _resident(executor: Executor) -> list[int]:
    return [procfs.resident_bytes()] + [procfs.resident_bytes(w.proc.pid) for w in executor.pool.workers]


@pytest.mark.slow
@pytest.mark.skipif(procfs.resident_bytes() is None, reason="no /proc here to read resident memory from")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_rank_holds_one_copy_of_its_weights(large_checkpoint, dtype):
    executor = Executor(executor_config(large_checkpoint, tp=2, dtype=dtype, max_num_seqs=1,
                                        max_model_len=PROMPT + 64))
    before = []
    executor.start(lambda phase: before.extend(_resident(executor)) if phase == "loading the weights" else None)
    try:
        blocks = executor.num_kv_blocks
        executor.step([SeqStep(0, [t % 256 for t in range(PROMPT)], 0, list(range(blocks)), fresh=True)])
        memory = executor.memory()
    finally:
        executor.shutdown()
    for rank, (m, base) in enumerate(zip(memory, before)):
        grown = m["resident_bytes"] - base
        print(f"{dtype} rank {rank}: weights {m['weight_bytes'] / 2**20:.1f} MiB, KV {m['kv_bytes'] / 2**20:.1f} MiB, "
              f"resident {base / 2**20:.1f} -> {m['resident_bytes'] / 2**20:.1f} MiB (+{grown / 2**20:.1f})")
        assert m["weight_bytes"] > 130e6 / (2 if dtype == "bfloat16" else 1)
        assert grown <= 1.1 * m["weight_bytes"] + m["kv_bytes"] + SLACK
