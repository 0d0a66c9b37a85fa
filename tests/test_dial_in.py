"""The dial-in port (`--worker-launcher connect`, neuron/rpc/dial_in.py) on loopback: what a rank
must say to be let in, and what anyone who can reach the port without the token can do to it
(lines that make a JSON decoder recurse, a hello trickled a byte at a time, hundreds of idle
connections, a rank dialling twice): the real ranks still join within the deadline, and the port
listens only while ranks are awaited. No network namespaces: hosts are names only here."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from server_harness import Records

from neuron.distributed.net import LOOPBACK
from neuron.errors import ConfigError
from neuron.rpc.dial_in import DialInFailed, Listener, cluster_token, dial

TOKEN = "tok"
BOMB = b"[" * 4000 + b"\n"  # json.loads recurses once per bracket: RecursionError
HELLO = 'the first line must be {"rank": N, "token": "..."}'


@pytest.fixture
def listener():
    listener = Listener(LOOPBACK, 0, TOKEN, hello_s=1.0)
    yield listener
    listener.close()


def _port(listener: Listener) -> int:
    return int(listener.address.rpartition(":")[2])


class Accepting:
    """`listener.accept(ranks, deadline_s)` in a thread: its connections, or what it raised, and
    how long it took."""

    def __init__(self, listener: Listener, ranks: set[int], deadline_s: float):
        self.got, self.error, self.took = {}, None, None
        self._thread = threading.Thread(target=self._run, args=(listener, ranks, deadline_s), daemon=True)
        self._thread.start()

    def _run(self, listener, ranks, deadline_s):
        t0 = time.monotonic()
        try:
            self.got = listener.accept(ranks, deadline_s)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            self.error = exc
        self.took = time.monotonic() - t0

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"accept still running after {timeout_s}s"
        for conn in self.got.values():
            conn.kill()


def _answer(port: int, raw: bytes) -> str:
    """Send `raw` as a hello and return the leader's answer line ('' when it closed without one)."""
    with socket.create_connection((LOOPBACK, port), timeout=10) as s:
        s.sendall(raw)
        return s.makefile("rb").readline().decode()


def _dial(port: int, rank: int, token: str = TOKEN) -> str:
    try:
        sock, _ = dial(f"{LOOPBACK}:{port}", rank, token, 10.0)
    except ConnectionRefusedError as exc:
        return str(exc)
    sock.close()
    return "welcome"


def test_a_dialling_rank_must_be_expected_and_say_who_it_is(listener):
    """Malformed greetings, unexpected ranks and wrong tokens are refused with a reason, logged
    with the peer's address and never with what it sent; the expected rank is welcomed; the
    deadline names who is missing."""
    port = _port(listener)
    with Records("neuron.dial_in") as logged:
        accepting = Accepting(listener, {1}, 20.0)
        answers = {name: _dial(port, rank, token) for name, rank, token in
                   (("wrong", 1, "bad-secret"), ("unexpected", 3, TOKEN), ("right", 1, TOKEN))}
        accepting.join(10)
    assert answers == {"wrong": "wrong cluster token", "unexpected": "rank 3 is not one this leader is waiting for",
                       "right": "welcome"}
    assert set(accepting.got) == {1}
    refusals = [r.getMessage() for r in logged.records if r.levelno == logging.WARNING]
    assert len(refusals) == 2 and all(f"from {LOOPBACK}:" in line for line in refusals)
    assert not any("bad-secret" in line for line in refusals)
    with pytest.raises(DialInFailed, match="rank.s. 2 did not dial in"):
        listener.accept({2}, 0.5)


def test_the_cluster_token_comes_from_the_setting_or_a_file(tmp_path):
    (tmp_path / "token").write_text("from-file\n")
    assert cluster_token("set", None) == "set"
    assert cluster_token(None, str(tmp_path / "token")) == "from-file"
    with pytest.raises(ConfigError, match="NEURON_CLUSTER_TOKEN"):
        cluster_token(None, None)


def test_a_hello_that_makes_a_decoder_recurse_is_refused(listener):
    """Five lines of 4,000 `[` waiting before the real rank: each is refused with a reason (none
    raises out of the wait), and the rank joins."""
    port = _port(listener)
    bombs = [socket.create_connection((LOOPBACK, port), timeout=10) for _ in range(5)]
    for s in bombs:
        s.sendall(BOMB)
    accepting = Accepting(listener, {1}, 10.0)
    try:
        answers = [s.makefile("rb").readline().decode() for s in bombs]
        assert _dial(port, 1) == "welcome"
        accepting.join(10)
    finally:
        for s in bombs:
            s.close()
    assert accepting.error is None and set(accepting.got) == {1}
    assert [json.loads(a) for a in answers] == [{"refused": f"{HELLO} (Expected `object`, got `array`)"}] * 5


def test_a_trickled_hello_has_one_deadline_and_holds_nothing_up(listener):
    """A connection trickling a byte every 0.1 s: rank 1 joins meanwhile, the trickle is refused
    when its whole hello is due (1 s here) though every byte came in time, and a wait for a rank
    that never comes ends at its own deadline whatever the trickle does."""
    port = _port(listener)
    stop = threading.Event()

    def trickle(answers: list[str]) -> None:
        with socket.create_connection((LOOPBACK, port), timeout=10) as s:
            s.settimeout(0.1)
            for byte in b'{"rank": 1, "token": "tok"' * 10:
                if stop.is_set():
                    return
                try:
                    s.sendall(bytes([byte]))
                    answers.append(s.recv(200).decode())
                    return
                except TimeoutError:
                    pass
                except OSError:
                    answers.append("closed")
                    return

    answers: list[str] = []
    trickler = threading.Thread(target=trickle, args=(answers,), daemon=True)
    started = time.monotonic()
    trickler.start()
    accepting = Accepting(listener, {1, 2}, 10.0)
    time.sleep(0.3)  # the trickle is being greeted
    t0 = time.monotonic()
    assert _dial(port, 1) == "welcome"
    assert time.monotonic() - t0 < 0.5
    trickler.join(5)
    assert [json.loads(a) for a in answers] == [{"refused": "it did not say who it is within 1 s"}]
    assert 1.0 <= time.monotonic() - started < 2.5
    assert _dial(port, 2) == "welcome"
    accepting.join(10)
    assert accepting.error is None and set(accepting.got) == {1, 2}

    answers.clear()
    accepting = Accepting(listener, {2}, 0.5)
    time.sleep(0.1)
    trickler = threading.Thread(target=trickle, args=(answers,), daemon=True)
    trickler.start()
    try:
        accepting.join(5)
        assert isinstance(accepting.error, DialInFailed) and accepting.took < 1.0
        trickler.join(5)
        assert [json.loads(a) for a in answers] == [{"refused": "this leader is no longer waiting for ranks"}]
    finally:
        stop.set()
        trickler.join(5)


def test_two_hundred_idle_connections_do_not_keep_the_rank_out(listener):
    """200 connections that say nothing, opened before the real rank dials: greeted at once
    rather than in turn, so the rank joins in well under one hello's deadline."""
    port = _port(listener)
    idle = []
    for _ in range(200):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((LOOPBACK, port))  # the kernel completes it; no waiting on a full backlog
        idle.append(s)
    try:
        accepting = Accepting(listener, {1}, 8.0)
        time.sleep(0.2)
        t0 = time.monotonic()
        assert _dial(port, 1) == "welcome"
        joined = time.monotonic() - t0
        accepting.join(10)
    finally:
        for s in idle:
            s.close()
    assert accepting.error is None and set(accepting.got) == {1}
    assert joined < 1.0  # a hello's deadline is 1 s here: no idle connection was waited out


def test_a_rank_is_a_real_integer_and_joins_once(listener):
    """`"rank": true` is not rank 1, and a second rank 1 while rank 2 is awaited is refused as a
    duplicate; ranks 1 and 2 join."""
    port = _port(listener)
    accepting = Accepting(listener, {1, 2}, 10.0)
    as_bool = _answer(port, b'{"rank": true, "token": "tok"}\n')
    first = _dial(port, 1)
    again = _dial(port, 1)
    second = _dial(port, 2)
    accepting.join(10)
    assert json.loads(as_bool) == {"refused": f"{HELLO} (Expected `int`, got `bool` - at `$.rank`)"}
    assert (first, again, second) == ("welcome", "rank 1 has already dialled in", "welcome")
    assert set(accepting.got) == {1, 2}


def test_the_port_listens_only_while_ranks_are_awaited(listener):
    """Once the ranks joined nothing listens (a connection is refused by the system); the next wait
    listens on the same port again; closing the listener ends a wait at once."""
    port = _port(listener)
    accepting = Accepting(listener, {1}, 10.0)
    assert _dial(port, 1) == "welcome"
    accepting.join(10)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((LOOPBACK, port), timeout=5).close()
    accepting = Accepting(listener, {1}, 10.0)
    assert _dial(port, 1) == "welcome"
    accepting.join(10)
    accepting = Accepting(listener, {1}, 10.0)
    time.sleep(0.2)
    t0 = time.monotonic()
    listener.close()
    accepting.join(5)
    assert isinstance(accepting.error, DialInFailed) and time.monotonic() - t0 < 0.5


def test_a_worker_dials_again_when_the_leader_closes_unanswered():
    """A leader that closes a connection without answering (it stopped waiting, or had too many
    connections saying hello) is dialled again; only an answer that refuses ends the worker."""
    server = socket.create_server((LOOPBACK, 0))
    port, hellos = server.getsockname()[1], []

    def leader():
        for answer in (b"", b'{"welcome":true}\n'):
            conn, _ = server.accept()
            with conn:
                hellos.append(conn.makefile("rb").readline())
                conn.sendall(answer)

    thread = threading.Thread(target=leader, daemon=True)
    thread.start()
    try:
        assert _dial(port, 1) == "welcome"
        thread.join(5)
    finally:
        server.close()
    assert hellos == [b'{"rank":1,"token":"tok"}\n'] * 2


class Hostile:
    """Everything the issue lists, against the port for as long as it runs: recursion bombs,
    trickles, bursts of idle connections and `"rank": true`, reconnecting whenever the port opens."""

    def __init__(self, port: int):
        self.port, self.stop, self.opened = port, threading.Event(), 0
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _connect(self) -> socket.socket | None:
        s = socket.socket()
        s.settimeout(0.5)
        try:
            s.connect((LOOPBACK, self.port))
        except OSError:
            s.close()
            return None
        self.opened += 1
        self._socks.append(s)
        return s

    def _run(self) -> None:
        while not self.stop.is_set():
            for payload in [BOMB] * 5 + [b'{"rank": true, "token": "x"}\n', b'{"ra', b"", b"", b""]:
                s = self._connect()
                if s is not None and payload:
                    try:
                        s.sendall(payload)
                    except OSError:
                        pass
            for s in self._socks[:-250]:  # the oldest go: a bounded number of descriptors
                s.close()
            del self._socks[:-250]
            time.sleep(0.05)

    def end(self) -> None:
        self.stop.set()
        self._thread.join(10)
        for s in self._socks:
            s.close()


def _after(condition, action) -> threading.Thread:
    """`action()` in a thread once `condition()` holds (or after a minute)."""

    def run():
        end = time.monotonic() + 60
        while not condition() and time.monotonic() < end:
            time.sleep(0.01)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_real_ranks_join_and_rebuild_while_the_port_is_attacked(odd_checkpoint, monkeypatch, tmp_path):
    """tp 2, rank 1 dialling in over loopback while the port is attacked throughout. The rank
    starts (as an orchestrator would) only once hostile connections reached the port, and after its
    connection is cut it dials again by itself only once they reached the reopened port: the start
    and the rebuild both finish within the worker start deadline, with transformers' tokens."""
    from checkpoints import reference_greedy
    from server_harness import wait_until

    from neuron import LLM, SamplingParams

    monkeypatch.setenv("NEURON_CLUSTER_TOKEN", TOKEN)
    monkeypatch.setenv("NEURON_WORKER_START_TIMEOUT_S", "30")
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port = s.getsockname()[1]
    hostile, workers = Hostile(port), []
    cmd = [sys.executable, "-m", "neuron", "--worker", "--connect", f"{LOOPBACK}:{port}", "--rank", "1",
           "--tp-size", "2", "--device", "cpu"]
    log = open(tmp_path / "worker.log", "wb")
    starter = _after(lambda: hostile.opened >= 20, lambda: workers.append(
        subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)))
    prompt = [5, 17, 200, 3, 9, 1]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        with LLM(str(odd_checkpoint), tensor_parallel_size=2, device="cpu", dtype="float32",
                 hosts="localhost:1,elsewhere:1", worker_launcher="connect", cluster_address=LOOPBACK,
                 cluster_port=port) as llm:
            first = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
            during_start = hostile.opened
            os.kill(workers[0].pid, signal.SIGSTOP)  # it dials again once resumed
            llm.engine.executor.pool.workers[0].proc.kill()  # rank 1's connection ends: a rebuild
            wait_until(lambda: llm.engine.failure is not None, 10, "the cut connection was not noticed")
            _after(lambda: hostile.opened >= during_start + 20, lambda: os.kill(workers[0].pid, signal.SIGCONT))
            t0 = time.monotonic()
            again = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
            rebuilt_in = time.monotonic() - t0
        assert workers[0].wait(timeout=30) == 0  # shut down by the leader, never refused
    finally:
        hostile.end()
        starter.join(60)
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        log.close()
    assert during_start >= 20 and hostile.opened >= during_start + 20
    assert first == again == reference_greedy(odd_checkpoint, prompt, 8)[0]
    assert rebuilt_in < 30
