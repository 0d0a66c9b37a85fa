"""Connections cannot hold the server's descriptors forever: a cap answered with 503, header, body
and idle deadlines, accept errors logged once per interval, descriptors kept for a rebuild, and a
warning when the API is open beyond loopback without a key."""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from caches import fresh_cache
from server_harness import LiveServer, Records, ScriptedEngine, open_fds, scripted_engine, wait_until

from neuron.entrypoints.openai import connections
from neuron.entrypoints.openai.connections import RateLimitFilter, connection_cap
from neuron.entrypoints.serve import warn_if_exposed
from neuron.utils import procfs

# `python -m neuron ARGS` under an open-file limit.
LIMITED = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
           "sys.argv[0] = 'neuron'; runpy.run_module('neuron', run_name='__main__')")
LIMITS = {"NEURON_MAX_CONNECTIONS": "4", "NEURON_HEADER_TIMEOUT_S": "0.5", "NEURON_BODY_TIMEOUT_S": "0.5",
          "NEURON_IDLE_TIMEOUT_S": "0.5"}


# ---- connections (a live server on a scripted engine) ----


@pytest.fixture(scope="module")
def guarded(default_tokenizer):
    """A live server with 4 connections at most and half-second header, body and idle deadlines."""
    with pytest.MonkeyPatch.context() as mp:  # read when the server is built, and only then
        for name, value in LIMITS.items():
            mp.setenv(name, value)
        server = LiveServer(scripted_engine(ScriptedEngine(default_tokenizer, {})))
    with server as s:
        s.wait_ready(10)
        s.address = ("127.0.0.1", int(s.url.rsplit(":", 1)[1]))
        yield s


def read_until_closed(sock: socket.socket, timeout_s: float = 5.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    sock.settimeout(timeout_s)
    t0, data = time.monotonic(), b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk




def envelope(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]


def test_idle_connections_are_closed_and_past_the_cap_clients_get_503(guarded):
    baseline = open_fds()
    idle = [socket.create_connection(guarded.address) for _ in range(4)]
    time.sleep(0.1)
    r = httpx.get(f"{guarded.url}/health")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "overloaded" and r.json()["error"]["type"] == "server_error"
    for sock in idle:  # they never sent a byte: closed at the header deadline, without an answer
        data, took = read_until_closed(sock)
        assert data == b"" and took < 1.5
        sock.close()
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    wait_until(lambda: open_fds() <= baseline, 5, f"descriptors left behind: {open_fds()} > {baseline}")


def test_half_a_head_gets_408(guarded):
    with socket.create_connection(guarded.address) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        data, took = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 ") and took < 1.5
    assert envelope(data)["code"] == "request_timeout"


def test_half_a_body_gets_408_and_no_error_is_logged(guarded):
    with Records("neuron", "uvicorn.error") as logged, socket.create_connection(guarded.address) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        data, took = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 ") and took < 1.5, data
    assert envelope(data)["code"] == "request_timeout"
    assert logged.errors() == []


def test_a_body_nobody_reads_does_not_hold_the_connection(guarded):
    """Answered without reading its body (405 here, a 401 alike), a trickling client is cut off."""
    with socket.create_connection(guarded.address) as sock:
        sock.sendall(b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc")
        trickling = threading.Event()

        def trickle() -> None:  # a byte every 0.2 s: each one would reset Uvicorn's keep-alive timer
            while not trickling.wait(0.2):
                try:
                    sock.send(b"x")
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        data, took = read_until_closed(sock)
        trickling.set()
    assert data.startswith(b"HTTP/1.1 405 ") and took < 1.5, took


def test_an_idle_keep_alive_connection_is_closed(guarded):
    with socket.create_connection(guarded.address) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, took = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200 ") and took < 1.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_an_idle_connection_attack_leaves_descriptors_for_a_rebuild(tmp_path):
    """`neuron serve --tp 2` under an open-file limit of 512 (the cap comes out at about 120): a
    thousand idle connections get 503 past the cap, a worker killed meanwhile is rebuilt, and the
    descriptors come back once the header deadline has closed the idle connections."""
    port, limit = free_port(), 512
    env = {**os.environ, "NEURON_CACHE_DIR": str(fresh_cache(tmp_path)), "NEURON_HEADER_TIMEOUT_S": "3"}
    proc = subprocess.Popen([sys.executable, "-c", LIMITED.format(soft=limit, hard=limit), "serve", "--tp", "2",
                             "--port", str(port), "--max-model-len", "256"], env=env, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def status() -> tuple[int | None, str]:
        try:
            r = httpx.get(f"{url}/health", timeout=5)
        except httpx.HTTPError as exc:
            return None, type(exc).__name__
        body = r.json()
        return r.status_code, body.get("status") or body["error"]["code"]

    try:
        wait_until(lambda: status() == (200, "ready"), 120, "the server did not start")
        before = open_fds(proc.pid)
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(1000)]
        time.sleep(0.5)
        assert limit - open_fds(proc.pid) >= connections.FD_RESERVE  # what is free during the attack
        assert status() == (503, "overloaded")
        [worker] = procfs.child_pids(proc.pid)
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: status() == (200, "ready"), 30, "no recovery while under attack")
        assert procfs.child_pids(proc.pid) not in ([], [worker])
        for sock in idle:
            sock.close()
        wait_until(lambda: open_fds(proc.pid) <= before, 10, f"descriptors kept: {open_fds(proc.pid)} > {before}")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_accept_errors_are_logged_once_per_interval():
    limit = RateLimitFilter(interval_s=0.2)

    def record() -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource",
                                 None, None)

    passed = [r for r in (record() for _ in range(1000)) if limit.filter(r)]
    assert len(passed) == 1
    time.sleep(0.25)
    late = record()
    assert limit.filter(late)
    assert late.getMessage() == "socket.accept() out of system resource (999 more like it in the last 0.2 s not logged)"


def test_the_connection_cap_leaves_descriptors_for_a_rebuild():
    """Run where the soft open-file limit is low: it is raised to the hard one, and the cap stays
    below it by the reserve."""
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = 2048 if limits[1] == resource.RLIM_INFINITY else min(limits[1], 2048)
    code = (f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, {hard})); "
            "from neuron.entrypoints.openai.connections import connection_cap; "
            "print(connection_cap(100000, 2), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    cap, soft = map(int, out.split())
    assert soft == hard
    reserve = connections.FD_RESERVE + 2 * connections.FD_RESERVE_PER_RANK + connections.MAX_LINGERING
    assert 0 < cap <= hard - reserve - 3  # stdin, stdout, stderr at least
    assert connection_cap(5, 2) == 5


def test_a_warning_when_the_api_is_open_beyond_loopback():
    with Records("neuron.server") as logged:
        assert warn_if_exposed("0.0.0.0", None)
        assert not warn_if_exposed("0.0.0.0", "key")
        assert not warn_if_exposed("127.0.0.1", None) and not warn_if_exposed("::1", None)
        assert not warn_if_exposed("localhost", None)
    [record] = logged.records
    assert record.levelno == logging.WARNING and "0.0.0.0 without an API key" in record.getMessage()


