"""Soak a server: many concurrent clients, a mix of streaming, non-streaming and abandoned requests,
while the server's memory and open files (leader and workers) are sampled for growth.

    python scripts/soak.py                                    # starts `neuron serve --tp 2` on the default model
    python scripts/soak.py --clients 64 --requests 600 --json soak.json
    python scripts/soak.py --url http://127.0.0.1:8000 --pid 1234    # an already running server

Every request must end with a complete answer (all its tokens, then [DONE] for a stream) or a clean
503 in the OpenAI error envelope; abandoned ones must be freed by the engine. RSS (VmRSS) and open
file descriptors of the server and its workers are compared at two quiet points, after a warm-up and
at the end, each with no client connected and no request running; growth beyond the slack fails the
run. A server the script started is then stopped with SIGTERM and must exit 0 with its workers gone.
Exit status: 0 when all of that holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx

from neuron.utils.procfs import alive, child_pids

PROMPTS = ["The morning train", "To make bread", "Rivers carry water", "The library opens", "In the autumn",
           "def add(a, b):", "She opened the door", "Questions and answers", "A list of colours:", "Once upon a time"]
KINDS = ("stream", "whole", "dropped_stream", "dropped_whole")


# ---- the server's processes ----


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1))
    except (OSError, AttributeError):
        return 0


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


@dataclass
class Sample:
    t: float
    done: int
    rss_kib: dict[int, int]
    fds: dict[int, int]

    @property
    def total_rss_kib(self) -> int:
        return sum(self.rss_kib.values())

    @property
    def total_fds(self) -> int:
        return sum(self.fds.values())


def sample(pid: int, t0: float, done: int) -> Sample:
    pids = [pid, *child_pids(pid)]
    return Sample(round(time.monotonic() - t0, 2), done, {p: rss_kib(p) for p in pids}, {p: open_fds(p) for p in pids})


# ---- starting a server ----


class Server:
    """`python -m neuron serve` on a free port; its log goes to a file so the pipe never fills."""

    def __init__(self, args):
        cmd = [sys.executable, "-m", "neuron", "serve", *([args.model] if args.model else []), "--tp", str(args.tp),
               "--port", "0", "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
               "--max-waiting", str(args.max_waiting), "--log-level", "info"]
        log_path = args.log
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        self.pid = self.proc.pid

    def wait_ready(self, timeout_s: float = 180) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(self.log_path) as f:
                found = re.search(r"ready: serving `[^`]*` at (http://[\d.]+:\d+)/v1", f.read())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"the server did not start; see {self.log_path}")

    def stop(self, timeout_s: float = 60) -> tuple[int | None, list[int]]:
        """SIGTERM; the exit code and the workers still alive afterwards."""
        workers = child_pids(self.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = None
        deadline = time.monotonic() + 5
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.log.close()
        return code, [w for w in workers if alive(w)]


# ---- clients ----


@dataclass
class Outcome:
    kind: str
    result: str  # complete, dropped, 503, or bad
    seconds: float
    detail: str = ""


def _request(rng: random.Random, model: str, kind: str) -> tuple[str, dict, int]:
    max_tokens = rng.randint(4, 48)
    body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": rng.choice([0.0, 0.8]),
            "seed": rng.randrange(1 << 30), "stream": kind in ("stream", "dropped_stream")}
    if rng.random() < 0.5:
        messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
        return "/v1/chat/completions", {**body, "messages": messages}, max_tokens
    return "/v1/completions", {**body, "prompt": rng.choice(PROMPTS)}, max_tokens


def _clean_503(r: httpx.Response) -> bool:
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return r.status_code == 503 and isinstance(error.get("message"), str) and bool(error.get("code"))


async def _stream(http: httpx.AsyncClient, path: str, body: dict, want: int, drop_after: int | None) -> tuple[str, str]:
    async with http.stream("POST", path, json={**body, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            await r.aread()
            return ("503", "") if _clean_503(r) else ("bad", f"{r.status_code} {r.text[:200]}")
        events, usage = 0, None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            if drop_after is not None and events >= drop_after:
                return "dropped", ""  # leaving the block closes the connection mid-stream
            data = line[6:]
            if data == "[DONE]":
                return ("complete", "") if usage == want else ("bad", f"{usage} of {want} tokens")
            chunk = json.loads(data)
            if "error" in chunk:
                return "bad", f"error event: {chunk['error']}"
            usage = (chunk.get("usage") or {}).get("completion_tokens")
        return "bad", "the stream ended without [DONE]"


async def _whole(http: httpx.AsyncClient, path: str, body: dict, want: int) -> tuple[str, str]:
    r = await http.post(path, json=body)
    if r.status_code != 200:
        return ("503", "") if _clean_503(r) else ("bad", f"{r.status_code} {r.text[:200]}")
    got = r.json()["usage"]["completion_tokens"]
    return ("complete", "") if got == want else ("bad", f"{got} of {want} tokens")


async def one_request(http: httpx.AsyncClient, rng: random.Random, model: str, kind: str) -> Outcome:
    path, body, want = _request(rng, model, kind)
    started = time.monotonic()
    try:
        if kind == "dropped_whole":  # the client gives up before the answer comes
            try:
                result, detail = await asyncio.wait_for(_whole(http, path, body, want), rng.uniform(0.01, 0.3))
            except asyncio.TimeoutError:
                result, detail = "dropped", ""
        else:
            drop_after = rng.randint(1, 4) if kind == "dropped_stream" else None
            result, detail = await _stream(http, path, body, want, drop_after) if body["stream"] else \
                await _whole(http, path, body, want)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        result, detail = "bad", f"{type(exc).__name__}: {exc}"
    return Outcome(kind, result, time.monotonic() - started, detail)


async def run_phase(url: str, model: str, clients: int, requests: int, rng: random.Random, deadline: float,
                    progress: list[int]) -> list[Outcome]:
    outcomes: list[Outcome] = []
    remaining = iter(range(requests))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:

        async def client() -> None:
            for _ in remaining:
                if time.monotonic() > deadline:
                    return
                kind = rng.choices(KINDS, weights=(40, 35, 15, 10))[0]
                outcome = await one_request(http, rng, model, kind)
                outcomes.append(outcome)
                progress[0] += 1
                if outcome.result == "503":  # a client that is told to come back later waits a little
                    await asyncio.sleep(rng.uniform(0.05, 0.2))

        await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes


def quiet(url: str, timeout_s: float = 30) -> bool:
    """Wait until the engine holds no request (abandoned ones included)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics").text
        busy = [float(v) for v in re.findall(r"^neuron_num_requests_(?:running|waiting)(?:\{[^}]*\})? (\S+)$", text, re.M)]
        if busy and not any(busy):
            return True
        time.sleep(0.2)
    return False


# ---- the run ----


@dataclass
class Report:
    date: str
    machine: str
    clients: int
    warmup_requests: int
    requests: int
    seconds: float
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)
    rss_kib_after_warmup: dict[str, int] = field(default_factory=dict)
    rss_kib_end: dict[str, int] = field(default_factory=dict)
    fds_after_warmup: dict[str, int] = field(default_factory=dict)
    fds_end: dict[str, int] = field(default_factory=dict)
    rss_growth_kib: int = 0
    fd_growth: int = 0
    peak_rss_kib: int = 0
    peak_fds: int = 0
    engine_idle_at_end: bool = False
    exit_code: int | None = None
    workers_left: list[int] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    ok: bool = False


def _roles(s: Sample, pid: int) -> dict[str, int]:
    return {("leader" if p == pid else f"worker {p}"): v for p, v in s.rss_kib.items()}


def _fd_roles(s: Sample, pid: int) -> dict[str, int]:
    return {("leader" if p == pid else f"worker {p}"): v for p, v in s.fds.items()}


def soak(args) -> Report:
    server = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        server = Server(args)
        url, pid = server.wait_ready(), server.pid
    model = httpx.get(f"{url}/v1/models", headers=_auth(args)).json()["data"][0]["id"]
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    deadline = t0 + args.time_limit
    progress = [0]
    samples: list[Sample] = []
    stop_sampling = threading.Event()

    def sampler() -> None:
        while not stop_sampling.wait(args.sample_interval_s):
            samples.append(sample(pid, t0, progress[0]))

    threading.Thread(target=sampler, daemon=True).start()
    warm = asyncio.run(run_phase(url, model, args.clients, args.warmup, rng, deadline, progress))
    idle = quiet(url)
    after_warmup = sample(pid, t0, progress[0])
    main = asyncio.run(run_phase(url, model, args.clients, args.requests, rng, deadline, progress))
    idle = quiet(url) and idle
    end = sample(pid, t0, progress[0])
    stop_sampling.set()
    seconds = time.monotonic() - t0

    outcomes = warm + main
    report = Report(time.strftime("%Y-%m-%d"), _machine(), args.clients, len(warm), len(main), round(seconds, 1))
    for kind in KINDS:
        report.outcomes[kind] = dict(Counter(o.result for o in outcomes if o.kind == kind))
    report.bad = [f"{o.kind}: {o.detail}" for o in outcomes if o.result == "bad"][:20]
    report.rss_kib_after_warmup, report.rss_kib_end = _roles(after_warmup, pid), _roles(end, pid)
    report.fds_after_warmup, report.fds_end = _fd_roles(after_warmup, pid), _fd_roles(end, pid)
    report.rss_growth_kib = end.total_rss_kib - after_warmup.total_rss_kib
    report.fd_growth = end.total_fds - after_warmup.total_fds
    everything = samples + [after_warmup, end]
    report.peak_rss_kib = max(s.total_rss_kib for s in everything)
    report.peak_fds = max(s.total_fds for s in everything)
    report.engine_idle_at_end = idle
    report.samples = [{"t": s.t, "done": s.done, "rss_kib": s.total_rss_kib, "fds": s.total_fds} for s in samples]
    if server is not None:
        report.exit_code, report.workers_left = server.stop()
    finished = len(outcomes) == args.warmup + args.requests
    rss_slack = max(args.rss_slack_mib * 1024, after_warmup.total_rss_kib * args.rss_slack_pct / 100)
    report.ok = (finished and not report.bad and idle and report.rss_growth_kib <= rss_slack
                 and report.fd_growth <= args.fd_slack and (server is None or report.exit_code == 0)
                 and not report.workers_left)
    return report


def _auth(args) -> dict[str, str]:
    return {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M).group(1)
    except (OSError, AttributeError):
        pass
    return f"{os.cpu_count()} cores, {cpu}"


def print_report(r: Report, args) -> None:
    total = {k: sum(v.get(k, 0) for v in r.outcomes.values()) for k in ("complete", "dropped", "503", "bad")}
    print(f"soak {r.date} on {r.machine}: {r.clients} clients, {r.warmup_requests} warm-up + {r.requests} requests "
          f"in {r.seconds:.1f} s")
    for kind, counts in r.outcomes.items():
        print(f"  {kind:15s} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"  total           complete {total['complete']}, dropped {total['dropped']}, 503 {total['503']}, "
          f"bad {total['bad']}")
    for line in r.bad:
        print(f"  BAD {line}")
    mib = 1 / 1024
    print(f"  RSS after warm-up {sum(r.rss_kib_after_warmup.values()) * mib:.1f} MiB "
          f"({', '.join(f'{k} {v * mib:.1f}' for k, v in r.rss_kib_after_warmup.items())}), "
          f"at the end {sum(r.rss_kib_end.values()) * mib:.1f} MiB, growth {r.rss_growth_kib * mib:+.1f} MiB "
          f"(slack {args.rss_slack_mib} MiB or {args.rss_slack_pct:g}%), peak {r.peak_rss_kib * mib:.1f} MiB")
    print(f"  open fds after warm-up {sum(r.fds_after_warmup.values())} ({r.fds_after_warmup}), at the end "
          f"{sum(r.fds_end.values())}, growth {r.fd_growth:+d} (slack {args.fd_slack}), peak {r.peak_fds}")
    print(f"  engine idle after each phase: {r.engine_idle_at_end}")
    if r.exit_code is not None or r.workers_left:
        print(f"  SIGTERM: exit code {r.exit_code}, workers left {r.workers_left or 'none'}")
    print("  OK" if r.ok else "  FAILED")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--url", help="soak this server instead of starting one (its /metrics must be reachable)")
    ap.add_argument("--pid", type=int, help="with --url: the server's process id, for RSS and fds")
    ap.add_argument("--api-key")
    ap.add_argument("--model", help="checkpoint for the server this script starts (default: the embedded one)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-waiting", type=int, default=256,
                    help="below clients - max-num-seqs, some requests get 503 overloaded (which counts as clean)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=400, help="requests after the warm-up")
    ap.add_argument("--warmup", type=int, help="warm-up requests (default: max(clients, requests / 4))")
    ap.add_argument("--time-limit", type=float, default=600, help="seconds; unfinished requests fail the run")
    ap.add_argument("--sample-interval-s", type=float, default=1.0)
    ap.add_argument("--rss-slack-mib", type=float, default=32.0)
    ap.add_argument("--rss-slack-pct", type=float, default=5.0)
    ap.add_argument("--fd-slack", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "neuron-soak-server.log"),
                    help="where the started server's log goes")
    ap.add_argument("--json", help="also write the report (with the samples) here")
    args = ap.parse_args(argv)
    if args.url and not args.pid:
        ap.error("--url needs --pid (the server's process id) to sample its memory and files")
    args.warmup = args.warmup if args.warmup is not None else max(args.clients, args.requests // 4)
    report = soak(args)
    print_report(report, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=1)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
