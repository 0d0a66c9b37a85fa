"""Decode steps from static, padded inputs (neuron/worker/cuda_graphs.py). On CPU the buffers and
the padding run eagerly, exactly as they would be captured, and must give the plain forward's
logits and leave every sequence's KV blocks as the plain forward does. Capture itself needs CUDA:
tests/test_gpu.py compares captured decode with eager decode there; here a stand-in graph that
replays by running its recorded step again checks what capture keeps (its output buffers)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from checkpoints import build_checkpoint

from neuron.distributed.comm import SingleRank
from neuron.layers.kernels import Kernels
from neuron.models import build_model
from neuron.models.loader import CheckpointReader, safetensors_files
from neuron.step import SeqStep
from neuron.worker.cuda_graphs import DecodeGraphs, batch_buckets
from neuron.worker.model_runner import ModelRunner
from neuron.worker.step_input import BlockTables

BLOCK = 4
MAX_LEN = 64
SLOTS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("graphs"), seed=5)


def _runner(path, paged: bool = True) -> ModelRunner:
    """A model runner over the checkpoint, as a rank loads it, without graphs yet."""
    config = json.loads((path / "config.json").read_text())
    model = build_model(config, SingleRank(), torch.float32, torch.device("cpu"), Kernels(paged=paged))
    with CheckpointReader(safetensors_files(path)) as r:
        model.load(r)
    blocks = SLOTS * MAX_LEN // BLOCK
    model.allocate(num_blocks=blocks, block_size=BLOCK, max_slots=SLOTS, max_model_len=MAX_LEN)
    return ModelRunner(model, blocks, BlockTables(SLOTS, blocks, BLOCK, MAX_LEN, torch.device("cpu"), paged))


def _step(runner: ModelRunner, seqs: list[SeqStep]) -> torch.Tensor:
    return runner.step(seqs).logits


def test_buckets_cover_every_batch_size_with_little_padding():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 4]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(10_000)[-1] == 512
    for size in range(1, 513):
        bucket = next(b for b in batch_buckets(512) if b >= size)
        assert bucket - size < max(16, size)


class _Replaying:
    """A CUDA graph's stand-in on CPU: a replay runs the recorded step again, on the same buffers."""

    def __init__(self):
        self.step = None

    def replay(self) -> None:
        self.step()

    def pool(self) -> str:
        return "pool"


def _capture_on_cpu(monkeypatch, graphs: DecodeGraphs) -> None:
    """Run `graphs.capture()` with stand-in graphs: every bucket must be recorded."""
    recording = []

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode=None):
        recording.append(g)
        try:
            yield
        finally:
            recording.pop()

    record = DecodeGraphs._recorded_step

    def recorded(self, bucket):
        recording[-1].step = lambda: record(self, bucket)
        return record(self, bucket)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Replaying)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(DecodeGraphs, "_recorded_step", recorded)
    monkeypatch.setattr(graphs, "_warm_up", graphs._forward)
    monkeypatch.setattr(graphs, "_synchronize", lambda: None)
    assert graphs.capture() == {}
    assert sorted(graphs.graphs) == graphs.buckets


@pytest.mark.parametrize("captured", [False, True])
def test_padded_decode_equals_the_plain_forward(checkpoint, monkeypatch, captured):
    """Prefill five sequences, then decode batches of 5, 3 and 1 (padded to 8, 4 and 1), crossing
    block boundaries: same logits, and the same KV in every block but the scratch one."""
    plain, padded = _runner(checkpoint), _runner(checkpoint)
    padded.graphs = DecodeGraphs(padded.model, max_batch=SLOTS)
    assert padded.graphs.buckets == [1, 2, 4, 8]
    if captured:
        _capture_on_cpu(monkeypatch, padded.graphs)
    prompts = {slot: list(range(3 + slot, 3 + slot + 5 + 2 * slot)) for slot in range(5)}
    blocks = {slot: list(range(slot * 16, slot * 16 + 16)) for slot in prompts}  # 16 blocks of 4 per slot
    prefill = [SeqStep(s, ids, 0, blocks[s], fresh=True) for s, ids in prompts.items()]
    for runner in (plain, padded):
        _step(runner, prefill)
    lengths = {s: len(ids) for s, ids in prompts.items()}
    for active in ([0, 1, 2, 3, 4], [0, 2, 4], [3], [0, 1, 2, 3, 4]):
        for _ in range(3):
            seqs = [SeqStep(s, [(7 * s + lengths[s]) % 256], lengths[s]) for s in active]
            expected, got = _step(plain, seqs), _step(padded, seqs)
            assert got.shape == (len(active), 256)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            for s in active:
                lengths[s] += 1
    _assert_same_kv(padded.model.cache, plain.model.cache)


@pytest.mark.parametrize("captured", [False, True])
def test_padded_verifying_steps_equal_the_plain_forward(checkpoint, monkeypatch, captured):
    """Speculative decoding's verifying steps (graphs of 4 tokens per sequence): sequences bring 1
    to 4 tokens and ask for the logits of their last 1 to 4, in batches of 5, 3 and 1 padded to 8, 4
    and 1, crossing block boundaries: the same logits, and the same KV in every block but the
    scratch one (where padding rows write)."""
    plain, padded = _runner(checkpoint), _runner(checkpoint)
    padded.verify_graphs = DecodeGraphs(padded.model, max_batch=SLOTS, query_len=4)
    if captured:  # every row's logits of a bucket, four per sequence, in the shared buffer
        _capture_on_cpu(monkeypatch, padded.verify_graphs)
        assert padded.verify_graphs.logits.shape == (8 * 4, 256)
    prompts = {slot: list(range(3 + slot, 3 + slot + 5 + 2 * slot)) for slot in range(5)}
    blocks = {slot: list(range(slot * 16, slot * 16 + 16)) for slot in prompts}
    prefill = [SeqStep(s, ids, 0, blocks[s], fresh=True) for s, ids in prompts.items()]
    for runner in (plain, padded):
        _step(runner, prefill)
    lengths = {s: len(ids) for s, ids in prompts.items()}
    for round_, active in enumerate(([0, 1, 2, 3, 4], [0, 2, 4], [3], [0, 1, 2, 3, 4])):
        for k in range(3):
            seqs = []
            for s in active:
                n = 1 + (s + k + round_) % 4
                seqs.append(SeqStep(s, [(7 * s + lengths[s] + j) % 256 for j in range(n)], lengths[s],
                                    logits=1 + (s + k) % n))
            batch = padded.tables.prepare(seqs)
            assert padded.verify_graphs.fits(batch) == (not batch.all_decode)
            expected, got = _step(plain, seqs), _step(padded, seqs)
            assert got.shape == expected.shape == (sum(s.logits for s in seqs), 256)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            for s in seqs:
                lengths[s.slot] += len(s.token_ids)
    _assert_same_kv(padded.model.cache, plain.model.cache)


def test_verifying_graphs_take_only_steps_that_fit(checkpoint):
    """More tokens than the graphs' query length, or padding rows past the model length, run the
    plain forward."""
    runner = _runner(checkpoint)
    graphs, tables = DecodeGraphs(runner.model, max_batch=2, query_len=4), runner.tables
    long = tables.prepare([SeqStep(0, [1, 2, 3, 4, 5], 0, [0, 1], fresh=True)])
    assert not graphs.fits(long)
    tables.commit(long)
    near_end = tables.prepare([SeqStep(1, list(range(MAX_LEN - 2)), 0, list(range(2, 2 + 16)), fresh=True)])
    tables.commit(near_end)
    assert graphs.fits(tables.prepare([SeqStep(0, [6, 7], 5, logits=2)]))
    assert not graphs.fits(tables.prepare([SeqStep(1, [6, 7], MAX_LEN - 2, logits=2)]))


def test_steps_that_do_not_fit_run_the_plain_forward(checkpoint):
    """A prefill chunk, or more sequences than the largest bucket, is not a graph's step."""
    runner = _runner(checkpoint)
    graphs, tables = DecodeGraphs(runner.model, max_batch=2), runner.tables
    prefill = tables.prepare([SeqStep(0, [1, 2, 3], 0, [0], fresh=True)])
    assert not graphs.fits(prefill)
    tables.commit(prefill)
    decode = tables.prepare([SeqStep(0, [4], 3)])
    assert graphs.fits(decode)
    three = tables.prepare([SeqStep(s, [1], 0, [s + 1], fresh=True) for s in (1, 2, 3)])
    assert three.all_decode and not graphs.fits(three)


def test_graphs_need_the_paged_cache(checkpoint):
    with pytest.raises(ValueError, match="paged"):
        DecodeGraphs(_runner(checkpoint, paged=False).model, max_batch=4)


def _assert_same_kv(padded, plain) -> None:
    """The same keys and values in every block before the scratch one (where padding rows write)."""
    rows = padded.scratch_block * BLOCK
    for layer in range(len(plain.k)):
        torch.testing.assert_close(padded.k[layer][:, :rows], plain.k[layer][:, :rows])
        torch.testing.assert_close(padded.v[layer][:, :rows], plain.v[layer][:, :rows])
