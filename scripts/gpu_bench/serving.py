"""The serve part (parent side): `neuron serve` driven by `neuron bench`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from gpu_bench.processes import kill_session, last_error_line
from gpu_bench.report import Row, fmt
from gpu_bench.workloads import Workloads


class PartFailed(Exception):
    pass


SERVE = "neuron serve"


def serve_row(shape: str, concurrency: int, value: float | None = None, error: str | None = None, note: str = "",
              detail: dict | None = None) -> Row:
    return Row("serve", shape, SERVE, f"concurrency {concurrency}", "out tok/s", value, error, note,
               detail=detail or {})


class ServeRun:
    """`neuron serve` in its own session on a free loopback port, driven by `neuron bench` with the
    offline (a) lengths; logprobs=0 because a checkpoint without a tokenizer streams no text, and
    only then does each token arrive in its own chunk to be timed."""

    def __init__(self, model: Path, device: str, dtype: str, work: Path, deadline_s: float, attention: str):
        self.model, self.device, self.dtype, self.work, self.deadline_s = model, device, dtype, work, deadline_s
        self.attention = attention

    def rows(self, shape: str, concurrency: tuple[int, ...], wl: Workloads) -> list[Row]:
        port, log_path = free_port(), self.work / "serve.log"
        cmd = [sys.executable, "-m", "neuron", "serve", str(self.model), "--port", str(port), "--device", self.device,
               "--dtype", self.dtype, "--max-num-seqs", str(max(concurrency)),
               "--max-model-len", str(wl.offline_a[1][1] + wl.offline_a[2][1]), "--log-level", "warning"]
        print(f"bench_gpu: serve-{shape} (log {log_path})", file=sys.stderr, flush=True)
        rows: list[Row] = []
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "NEURON_ATTENTION": self.attention})
        try:
            wait_ready(proc, port, self.deadline_s, log_path)
            for c in concurrency:
                rows.append(self.measure(port, shape, c, wl))
        except PartFailed as exc:
            rows += [serve_row(shape, c, error=f"failed: {exc}") for c in concurrency[len(rows):]]
        finally:
            stop_server(proc)
        return rows

    def measure(self, port: int, shape: str, concurrency: int, wl: Workloads) -> Row:
        import anyio

        from neuron.bench import BenchConfig, result_summary

        n = wl.serve_requests(concurrency)
        cfg = BenchConfig(f"http://127.0.0.1:{port}/v1", num_requests=n, concurrency=concurrency,
                          input_len=wl.offline_a[1], output_len=wl.offline_a[2], ignore_eos=True, logprobs=0,
                          seed=1000 + concurrency, warmup=1, timeout=self.deadline_s)
        try:
            s = result_summary(anyio.run(bench_within, cfg, self.deadline_s))
        except TimeoutError:
            return serve_row(shape, concurrency, error=f"failed: timed out after {self.deadline_s:g} s")
        detail = {"requests": n, "completed": s.completed, "failed": s.failed, "duration_s": s.duration_s,
                  "output_tokens": s.output_tokens, "ttft_p50_ms": s.ttft_ms.p50, "ttft_p99_ms": s.ttft_ms.p99,
                  "tpot_p50_ms": s.tpot_ms.p50, "tpot_p99_ms": s.tpot_ms.p99, "errors": s.errors}
        if not s.completed:
            error = next(iter(s.errors), "no request completed")
            return serve_row(shape, concurrency, error=f"failed: {error}", detail=detail)
        note = (f"attention {self.attention}; {n} requests; TTFT p50/p99 {fmt(s.ttft_ms.p50)} / {fmt(s.ttft_ms.p99)} ms; "
                f"TPOT p50/p99 {fmt(s.tpot_ms.p50)} / {fmt(s.tpot_ms.p99)} ms")
        if s.failed:
            note += f"; {s.failed} failed: {next(iter(s.errors))}"
        return serve_row(shape, concurrency, s.output_throughput, note=note, detail=detail)


async def bench_within(cfg, deadline_s: float):
    import anyio

    from neuron.bench import run_benchmark

    with anyio.fail_after(deadline_s):
        return await run_benchmark(cfg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, port: int, deadline_s: float, log_path: Path) -> None:
    import httpx

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PartFailed(f"neuron serve exited with code {proc.returncode}: {last_error_line(log_path)}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            if r.status_code == 200:
                return
            if r.status_code == 503 and r.json().get("status") == "failed":
                raise PartFailed(f"neuron serve failed to load: {last_error_line(log_path)}")
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise PartFailed(f"neuron serve not ready after {deadline_s:g} s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then SIGKILL to whatever is left in its session."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill_session(proc)
