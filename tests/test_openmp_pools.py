"""A thread that loads a model and lives on gives its OpenMP pool back (neuron/utils/openmp.py).

More pool threads than CPUs put every parallel region of every later step on libgomp's sleeping
path; the loading thread's pool did that to each model served on two cores.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from neuron.engine.loading import load_within
from neuron.utils.openmp import release_pool, then_release_pool

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")


def _native_threads() -> set[int]:
    """This process's OS threads that Python did not start (OpenMP's pool threads among them), by
    id: the tests ask which appeared, since one that an earlier test left may end meanwhile."""
    python = {t.native_id for t in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - python


def _parallel_work() -> None:
    torch.ones(1 << 24).add_(1.0)  # far above torch's grain: runs on every OpenMP thread


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _on_a_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()))
    thread.start()
    thread.join()
    return out["value"]


def test_release_pool_ends_the_calling_threads_pool(two_threads):
    baseline = _native_threads()

    def work():
        _parallel_work()
        with_pool = _native_threads()
        released = release_pool()
        return with_pool, released, _native_threads()

    with_pool, released, after = _on_a_thread(work)
    assert len(with_pool - baseline) == 1, "the parallel work should have made this thread a pool of one more thread"
    assert released
    assert after - baseline == set()


def test_a_load_leaves_no_pool_on_the_thread_that_holds_the_model(two_threads):
    baseline = _native_threads()
    holding, release = threading.Event(), threading.Event()

    def hold(_model) -> None:
        holding.set()
        release.wait(30)

    try:
        load_within(lambda phases: _parallel_work() or "model", timeout_s=30, hold=hold)
        assert holding.wait(30)
        assert _native_threads() - baseline == set()
    finally:
        release.set()


def test_work_handed_to_a_pooled_thread_releases_its_pool(two_threads):
    baseline = _native_threads()
    assert _on_a_thread(lambda: then_release_pool(_parallel_work) or _native_threads()) - baseline == set()


def test_an_engine_thread_gives_its_pool_back_while_it_idles(default_tokenizer, two_threads):
    """A host serving several models runs each on an engine thread of its own: an idle model's pool
    would count against the CPUs for the busy ones. The pool goes when the engine runs out of work
    and comes back with the next step."""
    from server_harness import LiveServer, ScriptedEngine, client, scripted_engine, wait_until

    during: list[set[int]] = []

    class Working(ScriptedEngine):
        def step(self):
            _parallel_work()
            during.append(_native_threads())
            return super().step()

    with LiveServer(scripted_engine(Working(default_tokenizer, {"hi": ["a", "b"]}))) as s:
        s.wait_ready(10)
        baseline = _native_threads()
        for _ in range(2):  # the pool is made again for the second request
            during.clear()
            answer = client(s).completions.create(model="stub", prompt="hi", max_tokens=4)
            assert answer.choices[0].text == "ab"
            assert during and max(len(d - baseline) for d in during) == 1, \
                "the steps should have run on a pool of one more thread"
            wait_until(lambda: _native_threads() - baseline == set(), 5, "the idle engine thread kept its pool")
