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
reads no per-step host state (`CausalLM.decode_on_device_only`). Steps that bring a prefill chunk,
ask for prompt logprobs or exceed the largest bucket run eagerly, as before.

Verifying steps of speculative decoding (engine/spec_decode) have graphs of their own, one per
batch-size bucket at a fixed `query_len` (1 + num_speculative_tokens): each sequence's row range
is query_len long, its real tokens first and padding after. Its padding rows sit at the positions
after its real tokens, so its real rows' causal attention never sees them, and write their keys and
values to the scratch block; padding sequences are query_len tokens at positions 0.. in the
scratch block. The graph returns every row's logits and the step keeps the rows it asked for. A
step fits when no sequence brings more than query_len tokens (a short prefill chunk fits too).

On CPU the same buffers and padding run eagerly (`capture=False`), which is how the tests check
the padding against the plain forward without a GPU.
"""

from __future__ import annotations

import logging

import torch

from neuron.layers.paged_attention import PagedAttentionMetadata
from neuron.models.inputs import StepBatch
from neuron.utils.device import to_device
from neuron.worker.step_input import blocks_for, logit_rows

log = logging.getLogger("neuron.worker")

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
    """Static inputs for decode steps (`query_len` 1) or verifying steps (`query_len` > 1) of up to
    `max(buckets)` sequences, and a graph per bucket once `capture` ran (CUDA only); `run` serves a
    step that `fits`."""

    def __init__(self, model, max_batch: int, query_len: int = 1):
        cache = model.cache
        if cache is None or not cache.paged:
            raise ValueError("decode graphs need the paged KV cache (NEURON_ATTENTION=paged)")
        self.model = model
        self.buckets = batch_buckets(max_batch)
        self.query_len = q = query_len
        n, dev = self.buckets[-1], cache.device
        self.block_size, self.max_len = cache.block_size, cache.max_len
        self.scratch_block = cache.scratch_block
        self.token_ids = torch.zeros(n * q, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n * q, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n * q,), self.scratch_block * self.block_size, dtype=torch.long, device=dev)
        self.kv_lens = torch.full((n,), q, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((n, blocks_for(cache.max_len, cache.block_size)), self.scratch_block,
                                       dtype=torch.int32,
                                       device=dev)
        self.query_start = torch.arange(0, n * q + 1, q, dtype=torch.int32, device=dev)  # query_len per sequence
        self.all_rows = torch.arange(n * q, dtype=torch.long, device=dev) if q > 1 else None  # every row's logits
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor | None] = {}
        self.failed: dict[int, str] = {}  # buckets that run eagerly, with why
        self._warm_up_stream: torch.cuda.Stream | None = None  # while capturing
        self.logits: torch.Tensor | None = None  # rank 0: every bucket's logits, rows of one buffer

    def fits(self, batch: StepBatch) -> bool:
        if batch.paged is None or batch.prompt_topk is not None or batch.pool is not None \
                or batch.paged.num_seqs > self.buckets[-1]:
            return False
        if self.query_len == 1:
            return batch.all_decode
        # a verifying step (or short chunks) whose padding rows stay inside the model length
        q = self.query_len
        return (not batch.all_decode and max(batch.lengths) <= q
                and all(kv - n + q <= self.max_len for kv, n in zip(batch.kv_lens, batch.lengths)))

    def bucket(self, size: int) -> int:
        return next(b for b in self.buckets if b >= size)

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """The step's logits (rank 0; None elsewhere), from its bucket's graph if captured."""
        size = batch.paged.num_seqs
        bucket = self.bucket(size)
        if self.query_len == 1:
            self._load(batch, size, bucket)
        else:
            self._load_verifying(batch, size, bucket)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            logits = self.outputs[bucket]
        else:
            logits = self._forward(bucket)
        if logits is None:
            return None
        if self.query_len == 1:
            return logits[:size].clone()  # a copy: the graph's output buffer is overwritten by the next replay
        return logits.index_select(0, to_device(self._kept_rows(batch), logits.device, torch.long))

    def _kept_rows(self, batch: StepBatch) -> list[int]:
        """The padded rows of the logits each sequence asked for: the last of its real rows."""
        return logit_rows(batch.lengths, batch.logit_counts or [1] * len(batch.lengths), stride=self.query_len)

    def _load_verifying(self, batch: StepBatch, size: int, bucket: int) -> None:
        """Copy the step into the static inputs, each sequence in rows i*q.. with padding after its
        real tokens; sequences size..bucket are padding sequences."""
        meta, q = batch.paged, self.query_len
        self._pad(0, bucket)  # every row padding first (scratch slots and tables); the real rows overwrite it
        real, positions = [], []
        for i, (n, kv) in enumerate(zip(batch.lengths, batch.kv_lens)):
            real += range(i * q, i * q + n)
            positions += range(kv - n, kv - n + q)  # its padding rows follow its real ones
        dev = self.token_ids.device
        dest = to_device(real, dev, torch.long)
        self.positions[: size * q].copy_(to_device(positions, dev, torch.long))
        self.token_ids.index_copy_(0, dest, batch.token_ids)
        self.slot_mapping.index_copy_(0, dest, meta.slot_mapping)
        self.kv_lens[:size].copy_(to_device([kv - n + q for kv, n in zip(batch.kv_lens, batch.lengths)], dev,
                                            torch.int32))
        self.block_tables[:size, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)

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
        """Make sequences start..end padding: query_len tokens at positions 0.. that write and read
        the scratch block."""
        q, bs = self.query_len, self.block_size
        pos = torch.arange(q, device=self.positions.device).repeat(end - start)
        self.token_ids[start * q : end * q].zero_()
        self.positions[start * q : end * q].copy_(pos)
        self.slot_mapping[start * q : end * q].copy_(self.scratch_block * bs + pos % bs)
        self.kv_lens[start:end].fill_(q)
        self.block_tables[start:end].fill_(self.scratch_block)

    def _batch(self, bucket: int) -> StepBatch:
        """A step over the first `bucket` sequences of the static inputs."""
        q, rows = self.query_len, bucket * self.query_len
        meta = PagedAttentionMetadata(self.query_start[: bucket + 1], self.kv_lens[:bucket],
                                      self.block_tables[:bucket], self.slot_mapping[:rows], self.block_size,
                                      max_query_len=q, max_kv_len=self.max_len)
        return StepBatch(self.token_ids[:rows], self.positions[:rows], meta.slot_mapping, slots=[],
                         lengths=[q] * bucket, kv_lens=[], last_index=None if q == 1 else self.all_rows[:rows],
                         all_decode=q == 1, read_rows=[], masks=[], paged=meta)

    def _forward(self, bucket: int) -> torch.Tensor | None:
        return self.model.forward(self._batch(bucket))

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
                if not self.graphs:  # the shared logits came from this failed capture's pool
                    self.logits = None
        self._synchronize()
        self._warm_up_stream = None
        clear_cublas_workspaces()
        return failed

    def _warm_up(self, bucket: int) -> None:
        """The bucket's step, eagerly, on a side stream (one for every bucket: cuBLAS keeps a
        workspace per stream), with any host synchronisation an error."""
        if self._warm_up_stream is None:
            self._warm_up_stream = torch.cuda.Stream()
        stream = self._warm_up_stream
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
        # cuBLAS's workspace for the capture stream is allocated inside the capture, from the graph's
        # pool, and forgotten after it: one kept from before would be memory the graph writes
        # without owning it, freed under it by the next clear (a model unloaded beside this one)
        clear_cublas_workspaces()
        # thread_local: rank 0 shares the leader's process, whose other threads may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self.outputs[bucket] = self._recorded_step(bucket)
        clear_cublas_workspaces()
        self.graphs[bucket] = graph
        return graph.pool()

    def _recorded_step(self, bucket: int) -> torch.Tensor | None:
        """The bucket's step as captured: its logits (every row of a verifying step) copied into
        the rows of the one shared buffer."""
        logits = self._forward(bucket)
        if logits is None:
            return None
        rows = logits.shape[0]  # bucket * query_len
        if self.logits is None:  # allocated in the first (largest) capture, from the shared pool
            self.logits = torch.empty_like(logits)
        self.logits[:rows].copy_(logits)
        return self.logits[:rows]

    @staticmethod
    def _synchronize() -> None:
        torch.cuda.synchronize()

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.logits = None


def clear_cublas_workspaces() -> None:
    """Free the workspaces cuBLAS keeps per (handle, stream) through the caching allocator, 32 MiB
    each on recent cards: they outlive the streams they were made for."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available():
        clear()


def capture_decode_graphs(model, max_batch: int, query_len: int = 1) -> DecodeGraphs | None:
    """Graphs for `model`'s decode steps (query_len 1) or verifying steps, or None (logged) when no
    bucket could be captured: those steps then run eagerly. A bucket that fails (an operation that
    synchronises with the host, a library that cannot be captured: a missing capability, not a
    wrong result) is dropped alone, logged with its reason."""
    graphs = DecodeGraphs(model, max_batch, query_len)
    kind = "decode" if query_len == 1 else f"verifying ({query_len} tokens per sequence)"
    try:
        failed = graphs.capture()
    except Exception as exc:  # the warm-up itself failed: nothing can be captured
        failed = dict.fromkeys(graphs.buckets, f"{type(exc).__name__}: {exc}")
    for bucket, why in sorted(failed.items()):
        log.warning("%s batches of %d run eagerly: their CUDA graph could not be captured (%s)", kind, bucket, why)
    if not graphs.graphs:
        graphs.release()
        log.warning("CUDA graphs off for %s steps, they run eagerly: no batch size could be captured", kind)
        return None
    graphs.failed = failed
    log.info("captured %s graphs for batch sizes %s", kind, ", ".join(map(str, sorted(graphs.graphs))))
    return graphs
