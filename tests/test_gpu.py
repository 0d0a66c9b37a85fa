"""On a CUDA device: the world-size-1 NCCL communicator, tp=2 on one GPU, memory given back
between one `LLM` and the next, and a CUDA server's worker killed and the ranks rebuilt. Marked
`gpu`: skipped, with that reason, where no CUDA device is present. The CPU test at the end checks
the release path itself."""

from __future__ import annotations

import gc
import os
import signal
import weakref

import pytest
import torch
from server_harness import wait_until

from neuron import LLM, SamplingParams
from neuron.utils.default_checkpoint import default_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40))]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


@pytest.mark.gpu
def test_nccl_world_size_one_all_reduces():
    pytest.importorskip("cupy", reason="the NCCL backend needs CuPy: pip install -e '.[cuda13]' (or cuda12)")
    from neuron.distributed.comm import NcclCommunicator, nccl_unique_id_hex

    comm = NcclCommunicator(0, 1, nccl_unique_id_hex(), torch.device("cuda:0"))
    t = torch.arange(8, dtype=torch.float32, device="cuda")
    comm.all_reduce(t)
    torch.cuda.synchronize()
    assert t.tolist() == list(range(8))
    gathered = comm.gather_to_rank0(t)
    assert len(gathered) == 1 and torch.equal(gathered[0], t)
    comm.close()


@pytest.mark.gpu
def test_tp2_on_one_gpu_matches_tp1():
    with LLM(tensor_parallel_size=1, device="cuda", dtype="float32", max_model_len=256) as llm:
        single = _tokens(llm)
    with LLM(tensor_parallel_size=2, device="cuda", dtype="float32", max_model_len=256) as llm:
        assert llm.engine.executor.backend == "gloo"  # two ranks on one device: NCCL refuses that
        assert _tokens(llm) == single


@pytest.mark.gpu
def test_one_llm_after_another_gets_the_same_pool():
    """Shutdown gives rank 0's weights and KV pool back: the next LLM sizes its pool alike."""
    pools, outputs = [], []
    for _ in range(2):
        with LLM(device="cuda", gpu_memory_utilization=0.5, max_model_len=256) as llm:
            pools.append(llm.engine.executor.num_kv_blocks)
            outputs.append(_tokens(llm))
    assert pools[0] == pools[1] > 0
    assert outputs[0] == outputs[1]
    assert torch.cuda.memory_allocated() < 64 * 2**20  # nothing of either model is left live


@pytest.mark.gpu
def test_a_killed_worker_of_a_cuda_engine_is_rebuilt_and_serves_again():
    with LLM(tensor_parallel_size=2, device="cuda", dtype="float32", gpu_memory_utilization=0.4,
             max_model_len=256) as llm:
        before = _tokens(llm)
        victim = llm.engine.executor.pool.workers[0].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        # the liveness monitor notices (within seconds); generate() then rebuilds the ranks first
        wait_until(lambda: llm.engine.failure is not None, 10, "the dead rank was not noticed")
        assert _tokens(llm) == before  # generate() finds the dead rank, rebuilds, and runs


@pytest.mark.gpu
def test_decode_from_cuda_graphs_matches_eager_decode(monkeypatch):
    """NEURON_ATTENTION=paged on CUDA captures decode graphs at load; three prompts decode in the
    bucket of four (one padding row), and give the tokens of eager paged decode and of the gather path."""
    prompts = [*PROMPTS, list(range(50, 57))]

    def tokens(**env) -> tuple[list[list[int]], int]:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with LLM(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8) as llm:
            runner = llm.engine.executor.rank0.models["model"]
            captured = len(runner.graphs.graphs) if runner.graphs is not None else 0
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert runner.graphs is None  # released at shutdown
        return [o.outputs[0].token_ids for o in outs], captured

    gathered, none = tokens(NEURON_ATTENTION="gather")
    captured, buckets = tokens(NEURON_ATTENTION="paged")
    eager, off = tokens(NEURON_ATTENTION="paged", NEURON_NO_CUDA_GRAPHS="1")
    assert (none, buckets, off) == (0, 4, 0)
    assert captured == eager == gathered


@pytest.mark.gpu
def test_cuda_graphs_are_captured_for_every_bucket(monkeypatch):
    monkeypatch.setenv("NEURON_ATTENTION", "paged")
    with LLM(device="cuda", max_model_len=256, max_num_seqs=20) as llm:
        graphs = llm.engine.executor.rank0.models["model"].graphs
        assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8, 16, 32]
        assert len(_tokens(llm)) == len(PROMPTS)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_on_cuda_replays_verifying_graphs(monkeypatch, method):
    """Verifying steps from their own CUDA graphs (4 tokens per sequence, buckets up to 8), a draft
    on the same device: greedy output as without speculation, and proposals were kept."""
    monkeypatch.setenv("NEURON_ATTENTION", "paged")
    spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "draft":
        spec = {"method": "draft", "model": str(default_model_dir()), "num_speculative_tokens": 3}
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(10, 40)) * 2]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    runs = []
    for config in (None, spec):
        # float32: a 4-row step and four 1-row steps round alike (bf16 could flip a near tie)
        with LLM(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8, speculative_config=config) as llm:
            runner = llm.engine.executor.rank0.models["model"]
            if config is not None:
                assert runner.verify_graphs is not None and sorted(runner.verify_graphs.graphs) == [1, 2, 4, 8]
                assert runner.verify_graphs.query_len == 4
            runs.append([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                      params)])
            if config is not None:
                assert llm.engine.spec.counts.accepted > 0
    assert runs[0] == runs[1]


def test_shutdown_releases_rank0_and_the_device_cache(monkeypatch):
    """The release path itself, on CPU: closing a rank drops its models, and on a CUDA rank the
    caching allocator's free blocks go back to the device."""
    from neuron.worker import worker as worker_mod

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", str(device))))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty", None)))
    worker_mod.release_device_memory(torch.device("cuda:1"))
    assert calls == [("sync", "cuda:1"), ("empty", None)]
    calls.clear()
    worker_mod.release_device_memory(torch.device("cpu"))
    assert calls == []

    # the device cache is emptied once nothing holds the models any more: a reference still held
    # then (a loop variable in close()) left a whole KV pool cached and counted as used on CUDA.
    # A runner someone else still holds (here this test) keeps no model either.
    llm = LLM(model=str(default_model_dir()), device="cpu", max_model_len=64)
    rank0 = llm.engine.executor.rank0
    assert list(rank0.models) == ["model"]
    runner = rank0.models["model"]
    model = weakref.ref(runner.model)
    alive_at_release = []
    monkeypatch.setattr(worker_mod, "release_device_memory",
                        lambda device: (gc.collect(), alive_at_release.append(model() is not None)))
    llm.shutdown()
    assert rank0.models == {} and runner.model is None
    assert alive_at_release == [False]


def test_the_gpu_checklist_runs_every_file_of_gpu_tests():
    """scripts/gpu_checklist.sh names the files it runs; a file with `gpu` tests that it leaves out
    would never run on the few machines lent with a GPU."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = (root / "scripts" / "gpu_checklist.sh").read_text()
    named = set(re.findall(r"\btest_\w+", script)) | set(re.findall(r"tests/(test_\w+)\.py", script))
    marked = {p.stem for p in (root / "tests").glob("test_*.py") if "@pytest.mark.gpu" in p.read_text()}
    assert marked and marked <= named, sorted(marked - named)
