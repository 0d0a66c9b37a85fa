"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches a few kernels per layer, each costing microseconds of host time, and for
small batches the host is slower than the GPU. Captured once at load, a step's hundreds of launches
(its collectives included, which NCCL records in the graph) become one replay.

A graph replays fixed shapes and fixed addresses, so a captured step reads static buffers: the
step's token ids, positions, pool rows to write, filled lengths and block tables are copied into
them, and the batch is padded up to its bucket. Padding rows are decodes of one token at position
0 whose key and value go to the cache's scratch block (a block past those the leader hands out)
and who attend to that one row: they never touch a sequence's blocks, and their logits are dropped.

What may be captured: the paged attention path (its metadata is device tensors and the Triton
kernel reads lengths from them; the gather path's shapes change every step), collectives that
run on the GPU stream (one rank, or NCCL: gloo is driven from the host), and models whose decode
reads no per-step host state (`CausalLM.supports_cuda_graphs`). Steps that bring a prefill chunk,
ask for prompt logprobs or exceed the largest bucket run eagerly, as before.

On CPU the same buffers and padding run eagerly (`capture=False`), which is how the tests check
the padding against the plain forward without a GPU.
"""

from __future__ import annotations

import logging

import torch

from neuron.layers.paged_attention import PagedAttentionMetadata
from neuron.models.step_input import StepBatch, blocks_for

log = logging.getLogger("neuron.models")

_SMALL_BUCKETS = (1, 2, 4, 8)
_BUCKET_STEP = 16
_MAX_BUCKET = 512  # larger decode batches pay little per-launch overhead per sequence; they run eagerly


def batch_buckets(max_batch: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then multiples of 16, up to the first that holds
    `max_batch` (at most 512). A step pads to the next bucket, wasting fewer than 16 rows."""
    top = min(max(max_batch, 1), _MAX_BUCKET)
    sizes = []
    for size in (*_SMALL_BUCKETS, *range(_BUCKET_STEP, _MAX_BUCKET + 1, _BUCKET_STEP)):
        sizes.append(size)
        if size >= top:
            break
    return sizes


class DecodeGraphs:
    """Static inputs for decode steps of up to `max(buckets)` sequences, and a graph per bucket
    once `capture` ran (CUDA only); `run` serves a step that `fits`."""

    def __init__(self, model, max_batch: int):
        cache = model.cache
        if cache is None or not cache.paged:
            raise ValueError("decode graphs need the paged KV cache (NEURON_ATTENTION=paged)")
        self.model = model
        self.buckets = batch_buckets(max_batch)
        n, dev = self.buckets[-1], cache.device
        self.block_size, self.max_len = cache.block_size, cache.max_len
        self.scratch_block = cache.scratch_block
        self.token_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), self.scratch_block * self.block_size, dtype=torch.long, device=dev)
        self.kv_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((n, blocks_for(cache.max_len, cache.block_size)), self.scratch_block,
                                       dtype=torch.int32,
                                       device=dev)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=dev)  # one query per sequence
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor | None] = {}
        self.failed: dict[int, str] = {}  # buckets that run eagerly, with why
        self.logits: torch.Tensor | None = None  # rank 0: every bucket's logits, rows of one buffer

    def fits(self, batch: StepBatch) -> bool:
        return (batch.paged is not None and batch.all_decode and batch.prompt_topk is None
                and batch.paged.num_seqs <= self.buckets[-1])

    def bucket(self, size: int) -> int:
        return next(b for b in self.buckets if b >= size)

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """The step's logits (rank 0; None elsewhere), from its bucket's graph if captured."""
        size = batch.paged.num_seqs
        bucket = self.bucket(size)
        self._load(batch, size, bucket)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            logits = self.outputs[bucket]
        else:
            logits = self._forward(bucket)
        # a copy: the graph's output buffer is overwritten by the next replay
        return None if logits is None else logits[:size].clone()

    def _load(self, batch: StepBatch, size: int, bucket: int) -> None:
        """Copy the step into the static inputs and make rows size..bucket padding."""
        meta = batch.paged
        self.token_ids[:size].copy_(batch.token_ids, non_blocking=True)
        self.positions[:size].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:size].copy_(meta.slot_mapping, non_blocking=True)
        self.kv_lens[:size].copy_(meta.kv_lens, non_blocking=True)
        self.block_tables[:size, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        if bucket > size:
            self._pad(size, bucket)

    def _pad(self, start: int, end: int) -> None:
        """Make rows start..end padding: one token at position 0 that writes and reads the scratch block."""
        self.token_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(self.scratch_block * self.block_size)
        self.kv_lens[start:end].fill_(1)
        self.block_tables[start:end, 0].fill_(self.scratch_block)

    def _batch(self, bucket: int) -> StepBatch:
        """A decode step over the first `bucket` rows of the static inputs."""
        meta = PagedAttentionMetadata(self.query_start[: bucket + 1], self.kv_lens[:bucket],
                                      self.block_tables[:bucket], self.slot_mapping[:bucket], self.block_size,
                                      max_query_len=1, max_kv_len=self.max_len)
        return StepBatch(self.token_ids[:bucket], self.positions[:bucket], meta.slot_mapping, slots=[],
                         lengths=[1] * bucket, kv_lens=[], last_index=None, all_decode=True, read_rows=[],
                         masks=[], paged=meta)

    def _forward(self, bucket: int) -> torch.Tensor | None:
        batch = self._batch(bucket)
        return self.model.run(self.model.embed(batch.token_ids), batch.positions, batch)

    @torch.inference_mode()
    def capture(self) -> dict[int, str]:
        """Record every bucket's step, largest first, sharing one memory pool; the buckets that
        could not be captured, with why. Such a bucket is dropped alone: its steps run eagerly, the
        other buckets replay. Each bucket first runs eagerly (kernels compile and libraries set up
        then, since none of that may happen during capture) with host synchronisation an error, so
        an operation that would break capture is named; after capture its replay must equal that
        eager step. Every rank captures the same buckets in the same order, so the collectives
        inside stay matched. The static inputs are all padding meanwhile, so nothing is written to
        a sequence's blocks."""
        self._pad(0, self.buckets[-1])
        failed, pool = {}, None
        for bucket in reversed(self.buckets):
            try:
                self._warm_up(bucket)
                pool = self._capture_bucket(bucket, pool)
                self._check_replay(bucket)
            except Exception as exc:  # noqa: BLE001 - a bucket that cannot be captured runs eagerly
                text = str(exc).strip()
                failed[bucket] = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
                self.graphs.pop(bucket, None)
                self.outputs.pop(bucket, None)
        self._synchronize()
        return failed

    def _warm_up(self, bucket: int) -> None:
        """The bucket's step, eagerly, on a side stream, with any host synchronisation an error."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(stream):
                self._forward(bucket)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
        torch.cuda.current_stream().wait_stream(stream)

    def _check_replay(self, bucket: int) -> None:
        """Rank 0 (the one with logits): the bucket's replay equals its eager step."""
        if self.outputs.get(bucket) is None:
            return
        self.graphs[bucket].replay()
        replayed = self.outputs[bucket].clone()
        eager = self._forward(bucket)
        diff = (replayed - eager).abs().max().item()
        if not diff <= 1e-3 * max(eager.abs().max().item(), 1.0):  # NaN fails too
            raise ValueError(f"its replay differs from the eager step by {diff:.3g}")

    def _capture_bucket(self, bucket: int, pool):
        """Record one bucket's step into a graph; the memory pool the next capture shares. The
        logits land in rows of one buffer that every bucket shares (rank 0's; the other ranks have
        none), so the graphs keep one [largest bucket, vocab] of them alive, not one per bucket,
        and the step's own output is freed back to the pool for the next capture."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: rank 0 shares the leader's process, whose other threads may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            logits = self._forward(bucket)
            if logits is not None:
                if self.logits is None:  # allocated in the first (largest) capture, from the shared pool
                    self.logits = torch.empty_like(logits)
                self.logits[:bucket].copy_(logits)
                logits = self.logits[:bucket]
            self.outputs[bucket] = logits
        self.graphs[bucket] = graph
        return graph.pool()

    @staticmethod
    def _synchronize() -> None:
        torch.cuda.synchronize()

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.logits = None


def capture_decode_graphs(model, max_batch: int) -> DecodeGraphs | None:
    """Graphs for `model`'s decode steps, or None (logged) when no bucket could be captured: decode
    then runs eagerly. A bucket that fails (an operation that synchronises with the host, a library
    that cannot be captured: a missing capability, not a wrong result) is dropped alone, logged with
    its reason."""
    graphs = DecodeGraphs(model, max_batch)
    try:
        failed = graphs.capture()
    except Exception as exc:  # the warm-up itself failed: nothing can be captured
        failed = dict.fromkeys(graphs.buckets, f"{type(exc).__name__}: {exc}")
    for bucket, why in sorted(failed.items()):
        log.warning("decode batches of %d run eagerly: their CUDA graph could not be captured (%s)", bucket, why)
    if not graphs.graphs:
        graphs.release()
        log.warning("CUDA graphs off, decode runs eagerly: no batch size could be captured")
        return None
    graphs.failed = failed
    log.info("captured decode graphs for batch sizes %s", ", ".join(map(str, sorted(graphs.graphs))))
    return graphs
