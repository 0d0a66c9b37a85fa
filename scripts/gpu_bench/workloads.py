"""The sizes of every run: the fixed workloads of a full and a --tiny run, and the drawn prompts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workloads:
    decode_prompt: int  # batch-1 prompt length
    decode_tokens: int  # batch-1 new tokens
    repeats: int  # batch-1 runs timed (median)
    offline_a: tuple[int, tuple[int, int], tuple[int, int]]  # prompts, input lengths, output lengths
    offline_b: tuple[int, tuple[int, int], tuple[int, int]]
    serve_concurrency: tuple[int, ...]  # the last equals offline_a's prompts: the same batch
    serve_min_requests: int
    copy_bytes: int
    shard_bytes: int  # larger checkpoints are written in shards of about this size
    deadline_s: float  # per subprocess

    def serve_requests(self, concurrency: int) -> int:
        return max(self.serve_min_requests, 2 * concurrency)


FULL = Workloads(decode_prompt=128, decode_tokens=256, repeats=3, offline_a=(64, (100, 1024), (256, 256)),
                 offline_b=(256, (100, 1024), (100, 1024)), serve_concurrency=(1, 8, 32, 64), serve_min_requests=16,
                 copy_bytes=1 << 30, shard_bytes=4 << 30, deadline_s=1800.0)
TINY = Workloads(decode_prompt=16, decode_tokens=8, repeats=2, offline_a=(4, (16, 32), (8, 8)),
                 offline_b=(4, (16, 32), (4, 8)), serve_concurrency=(1, 4), serve_min_requests=4,
                 copy_bytes=64 << 20, shard_bytes=4 << 30, deadline_s=120.0)


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @classmethod
    def drawn(cls, n: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> Workload:
        """Token-id prompts from the generator `neuron bench` uses, so offline and served runs match."""
        from neuron.bench.prompts import build_requests

        reqs = build_requests(n, seed=seed, input_len=input_len, output_len=output_len, token_ids=True)
        return cls([r.prompt for r in reqs], [r.max_tokens for r in reqs])

    def describe(self) -> str:
        ins, outs = [len(p) for p in self.prompts], self.max_tokens
        span = lambda v: f"{min(v)}-{max(v)}" if min(v) != max(v) else str(v[0])  # noqa: E731
        return f"{len(ins)} prompt{'s' if len(ins) > 1 else ''}, {span(ins)} tokens in, {span(outs)} out"
