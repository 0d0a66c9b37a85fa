"""Each CPU rank's cores (`--cpu-bind`, neuron/executor/cpu_bind.py): the plan for auto, nobind and
explicit lists, refusals in one line, real ranks bound to their cores once they step, and ranks that
outnumber the cores waiting asleep with a thread per core."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from neuron.errors import ConfigError
from neuron.executor import cpu_bind
from neuron.worker.worker import cpu_threads


def test_lists_read_and_write_as_vllm_writes_them():
    assert cpu_bind.parse_cpu_list("0-3,8, 10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert cpu_bind.format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    for bad in ("", "a", "3-1", "1-", "0-99999"):
        with pytest.raises(ValueError):
            cpu_bind.parse_cpu_list(bad)


def test_auto_gives_each_rank_a_numa_node_when_they_match_else_an_even_split():
    nodes = [[0, 1, 2, 3], [4, 5, 6, 7]]
    usable = list(range(8))
    assert cpu_bind.plan("auto", 2, usable, nodes) == nodes
    assert cpu_bind.plan("auto", 4, usable, nodes) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cpu_bind.plan("auto", 3, usable, [usable]) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert cpu_bind.plan("auto", 3, [0, 1], [[0, 1]]) == [[], [], []]  # fewer cores than ranks: unbound
    assert cpu_bind.plan("nobind", 2, usable, nodes) == [[], []]
    assert cpu_bind.describe(cpu_bind.plan("auto", 2, usable, nodes)) == "rank 0: 0-3, rank 1: 4-7"
    assert cpu_bind.describe([[], []]) == "not bound"


def test_numa_nodes_are_read_from_sys_and_keep_only_usable_cores(tmp_path):
    for node, cpus in (("node0", "0-3"), ("node1", "4-7"), ("node2", "")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    assert cpu_bind.numa_nodes([1, 2, 5], tmp_path) == [[1, 2], [5]]
    assert cpu_bind.numa_nodes([0, 1], tmp_path / "missing") == [[0, 1]]


@pytest.mark.parametrize("spec, words", [
    ("0-3", "gives 1 core list(s) for 2 rank(s)"),
    ("0-1|1-2", "core(s) 1 are given to two ranks"),
    ("0|x", "rank 1's cores 'x'"),
    ("0|4096", "rank 1's cores 4096 are not among the cores this process may use"),
])
def test_explicit_lists_are_refused_naming_what_is_wrong(spec, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        cpu_bind.plan(spec, 2, [0, 1, 2, 3])
    assert cpu_bind.plan("0,2|1,3", 2, [0, 1, 2, 3]) == [[0, 2], [1, 3]]


def test_ranks_that_outnumber_the_cores_wait_asleep_with_a_thread_per_core():
    assert cpu_bind.worker_env(3, [0, 1], environ={}) == {"OMP_WAIT_POLICY": "passive"}
    assert cpu_bind.worker_env(2, [0, 1], environ={}) == {}  # a core each: bound, one thread, spinning
    assert cpu_bind.worker_env(3, [0, 1], environ={"OMP_WAIT_POLICY": "active"}) == {}  # the user's choice stands
    assert cpu_threads(3, 2, "passive") == 2
    assert cpu_threads(3, 2, " PASSIVE ") == 2
    assert cpu_threads(3, 2, None) == 1  # rank 0: the leader's OpenMP spins, so one thread
    assert cpu_threads(3, 2, "active") == 1
    assert cpu_threads(2, 8, "passive") == 4  # enough cores: each rank its part, whatever the policy
    assert cpu_threads(3, 8, None) == 2


def test_a_rank_that_waits_asleep_runs_steps_of_few_rows_on_one_thread(monkeypatch):
    import torch

    from neuron.layers import cpu_ops
    from neuron.worker import worker

    monkeypatch.setattr(cpu_ops, "_alone_rows", 0)  # restored after the test, as this process's threads are
    monkeypatch.delenv("NEURON_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
        worker.set_cpu_threads(2)  # a rank's part of enough cores: every step on them
        assert torch.get_num_threads() == 2 and cpu_ops.threads_for(1) == 2

        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        worker.set_cpu_threads(3)  # spinning: one thread for every step
        assert torch.get_num_threads() == 1 and cpu_ops.threads_for(worker.ALONE_ROWS + 1) == 1

        monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
        worker.set_cpu_threads(3)  # asleep: a thread per core, steps of few rows alone
        assert torch.get_num_threads() == 2
        assert cpu_ops.threads_for(1) == cpu_ops.threads_for(worker.ALONE_ROWS) == 1
        assert cpu_ops.threads_for(worker.ALONE_ROWS + 1) == 2
    finally:
        torch.set_num_threads(before)


def _allowed(pid: int, tid: int | None = None) -> list[int]:
    status = Path(f"/proc/{pid}/task/{tid}/status" if tid else f"/proc/{pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("Cpus_allowed_list:"))
    return cpu_bind.parse_cpu_list(line.split(":", 1)[1])


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding two ranks needs two cores")
def test_each_rank_steps_on_its_own_cores(odd_checkpoint, caplog):
    import logging
    import threading

    from neuron import LLM, SamplingParams

    usable = sorted(os.sched_getaffinity(0))
    expected = cpu_bind.plan("auto", 2, usable)
    seen = {}

    def serve() -> None:  # steps on a thread of its own, as the server's engine thread does
        with LLM(str(odd_checkpoint), tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=64) as llm:
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, temperature=0.0))
            executor = llm.engine.executor
            seen["plan"] = executor.cpu_bind
            seen["worker"] = _allowed(executor.pool.workers[0].proc.pid)  # its main thread steps
            seen["stepping"] = _allowed(os.getpid(), threading.get_native_id())
            seen["main"] = _allowed(os.getpid())
            executor.restart()  # the ranks rebuilt (a recovery): rank 0 binds again on its next step
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, temperature=0.0))
            seen["rebuilt"] = _allowed(os.getpid(), threading.get_native_id())
        seen["after"] = _allowed(os.getpid(), threading.get_native_id())

    with caplog.at_level(logging.INFO, logger="neuron.executor"):
        thread = threading.Thread(target=serve)
        thread.start()
        thread.join(120)
    assert seen["plan"] == expected
    assert seen["worker"] == expected[1]
    assert seen["stepping"] == expected[0]  # rank 0's steps run on its cores
    assert seen["main"] == usable  # and nothing else of the leader's is bound
    assert seen["rebuilt"] == expected[0]
    assert seen["after"] == usable  # closing gives the thread the cores it had before it was first bound
    assert f"CPU ranks bound to cores: {cpu_bind.describe(expected)}" in caplog.text


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) >= 4, reason="four ranks outnumber the cores only below four cores")
def test_worker_ranks_that_outnumber_the_cores_wait_asleep(odd_checkpoint, monkeypatch, caplog):
    import logging

    from neuron import LLM, SamplingParams

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("NEURON_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    prompt = [{"prompt_token_ids": [1, 2, 3, 4, 5]}]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    with caplog.at_level(logging.INFO, logger="neuron.executor"):
        with LLM(str(odd_checkpoint), tensor_parallel_size=4, device="cpu", dtype="float32", max_model_len=64) as llm:
            got = llm.generate(prompt, greedy)[0].outputs[0].token_ids
            workers = llm.engine.executor.pool.workers
            environs = [Path(f"/proc/{w.proc.pid}/environ").read_bytes().split(b"\0") for w in workers]
    assert len(environs) == 3 and all(b"OMP_WAIT_POLICY=passive" in e for e in environs)
    assert "OMP_WAIT_POLICY" not in os.environ  # the leader's own environment is left alone
    assert f"4 CPU ranks share {cores} cores" in caplog.text
    with LLM(str(odd_checkpoint), tensor_parallel_size=1, device="cpu", dtype="float32", max_model_len=64) as llm:
        assert llm.generate(prompt, greedy)[0].outputs[0].token_ids == got
