"""Ranks on several hosts (neuron/executor/placement.py), the hosts simulated by Linux network
namespaces the tests create: a bridge in this namespace with the leader's address, and a veth
into each "host" with its own; `ip netns exec {host}` is the launcher. Skipped, with the reason,
where namespaces cannot be created (not root, no `ip`)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
from checkpoints import ODD, build_checkpoint, reference_greedy
from server_harness import wait_until

from neuron import LLM, SamplingParams
from neuron.distributed.net import LOOPBACK, address_towards, interface_address, interface_of
from neuron.errors import ConfigError
from neuron.executor.placement import Placement, cluster_address, launcher_argv, parse_hosts

PROMPTS = [[5, 17, 200, 3, 9, 1], list(range(10, 22)), [7, 8, 9]]
LAUNCHER = "ip netns exec {host}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Hosts:
    """A bridge holding the leader's address and `n` namespaces behind veth pairs on it."""

    def __init__(self, n: int):
        tag = os.getpid() % 10000
        self.subnet = f"10.213.{tag % 250}"
        self.leader = f"{self.subnet}.1"
        self.bridge = f"nb{tag}"
        self.names = [f"nrn{tag}h{i}" for i in range(1, n + 1)]
        self.links = [f"nv{tag}x{i}" for i in range(1, n + 1)]

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.leader}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, (name, link) in enumerate(zip(self.names, self.links), start=2):
            _ip("netns", "add", name)
            _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", link, "master", self.bridge, "up")
            _ip("-n", name, "addr", "add", f"{self.subnet}.{i}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def down(self) -> None:
        for name in self.names:
            _ip("netns", "del", name, check=False)
        _ip("link", "del", self.bridge, check=False)


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("creating network namespaces needs root and iproute2's ip")
    h = Hosts(2)
    try:
        h.up()
        # the namespaces reach the leader's address (and nothing else is set up for them)
        subprocess.run(["ip", "netns", "exec", h.names[0], "python3", "-c",
                        f"import socket; socket.create_connection(('{h.leader}', 9), 1)"],
                       capture_output=True, timeout=30)
    except (subprocess.CalledProcessError, OSError) as exc:
        h.down()
        pytest.skip(f"cannot create network namespaces here: {getattr(exc, 'stderr', '') or exc}")
    yield h
    h.down()


@pytest.fixture(scope="module")
def odd_checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("multihost"), seed=3, **ODD)


def _reap(procs) -> None:
    """Kill whatever of these processes still runs."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _assert_reference(path, got: list[list[int]]) -> None:
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == reference_greedy(path, prompt, 8)[0]


def _greedy(llm: LLM, n: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def _llm(path, hosts: Hosts, spec: str, tp: int) -> LLM:
    return LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32", hosts=spec,
               worker_launcher=LAUNCHER, cluster_address=hosts.leader)


@pytest.mark.parametrize("tp,layout", [(2, "localhost:1,{0}:1"), pytest.param(4, "localhost:2,{0}:1,{1}:1",
                                                                                  marks=pytest.mark.slow)])
def test_ranks_on_other_hosts_equal_transformers(odd_checkpoint, hosts, tp, layout):
    """tp 2 with rank 1 on another host, tp 4 over three hosts: transformers' greedy tokens."""
    with _llm(odd_checkpoint, hosts, layout.format(*hosts.names), tp) as llm:
        assert llm.engine.executor.backend == "gloo"
        assert llm.engine.executor.cluster_address == hosts.leader
        got = _greedy(llm)
    _assert_reference(odd_checkpoint, got)


@pytest.mark.slow
def test_a_killed_remote_rank_is_rebuilt_through_the_launcher(odd_checkpoint, hosts):
    """The rank in the other namespace killed: the ranks are rebuilt (the launcher starts it
    again) and the next requests get the same tokens."""
    with _llm(odd_checkpoint, hosts, f"localhost:1,{hosts.names[0]}:1", 2) as llm:
        first = _greedy(llm)
        victim = llm.engine.executor.pool.workers[0].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        wait_until(lambda: llm.engine.failure is not None, 10, "the dead rank was not noticed")
        assert _greedy(llm) == first


@pytest.mark.slow
def test_a_link_taken_down_mid_run_fails_it_within_the_deadline(odd_checkpoint, hosts, monkeypatch):
    """The other host's link goes down while a generation runs (before its 20th step): it fails
    within the collective deadline (not hanging), and once the link is back the ranks are rebuilt
    and give the same tokens as before."""
    import time

    from neuron.errors import NeuronError

    monkeypatch.setenv("NEURON_COLLECTIVE_TIMEOUT_S", "3")
    monkeypatch.setenv("NEURON_TP_STEP_TIMEOUT_S", "6")
    link = hosts.links[0]
    with _llm(odd_checkpoint, hosts, f"localhost:1,{hosts.names[0]}:1", 2) as llm:
        first = _greedy(llm)
        executor, steps = llm.engine.executor, []
        step = executor.step

        def cut_at_20(seqs):
            steps.append(time.monotonic())
            if len(steps) == 20:
                _ip("link", "set", link, "down")
            return step(seqs)

        monkeypatch.setattr(executor, "step", cut_at_20)
        try:
            with pytest.raises(NeuronError, match="generation failed"):
                llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                             SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
            assert len(steps) == 20 and time.monotonic() - steps[-1] < 6 + 5  # the step deadline, some slack
        finally:
            _ip("link", "set", link, "up")
        monkeypatch.undo()
        assert _greedy(llm) == first


def _free_port(address: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _dial_in(hosts: Hosts, host: str, port: int, rank: int, tp: int, token: str) -> subprocess.Popen:
    """A worker an orchestrator would start: in `host`'s namespace, dialling the leader."""
    import sys

    cmd = ["ip", "netns", "exec", host, sys.executable, "-m", "neuron", "--worker", "--connect",
           f"{hosts.leader}:{port}", "--rank", str(rank), "--tp-size", str(tp), "--device", "cpu"]
    return subprocess.Popen(cmd, env={**os.environ, "NEURON_CLUSTER_TOKEN": token}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_ranks_that_dial_in(odd_checkpoint, hosts, monkeypatch, caplog):
    """--worker-launcher connect: the test starts the workers, which dial the leader. One with a
    wrong token is refused (exit 2, logged without what it sent) and the right one still starts;
    tp 2 gives transformers' tokens; a dialled-in rank killed is replaced by the next one the
    orchestrator starts, and the ranks serve again."""
    import logging

    token, wrong = "s3cret-token", "not-the-token"
    monkeypatch.setenv("NEURON_CLUSTER_TOKEN", token)
    port = _free_port(hosts.leader)
    impostor = _dial_in(hosts, hosts.names[1], port, 1, 2, wrong)
    workers = []
    caplog.set_level(logging.INFO, logger="neuron.dial_in")

    def start_the_right_one_once_refused():
        impostor.wait(timeout=60)
        workers.append(_dial_in(hosts, hosts.names[0], port, 1, 2, token))

    import threading

    orchestrator = threading.Thread(target=start_the_right_one_once_refused)
    orchestrator.start()
    try:
        with LLM(str(odd_checkpoint), tensor_parallel_size=2, device="cpu", dtype="float32",
                 hosts=f"localhost:1,{hosts.names[0]}:1", worker_launcher="connect", cluster_address=hosts.leader,
                 cluster_port=port) as llm:
            orchestrator.join()
            assert impostor.wait(timeout=30) == 2
            assert "wrong cluster token" in caplog.text and wrong not in caplog.text and token not in caplog.text
            got = _greedy(llm)
            workers[0].kill()
            workers[0].wait(timeout=30)
            wait_until(lambda: llm.engine.failure is not None, 10, "the dead rank was not noticed")
            workers.append(_dial_in(hosts, hosts.names[0], port, 1, 2, token))  # the orchestrator restarts it
            assert _greedy(llm) == got
        assert workers[1].wait(timeout=30) == 0  # shut down by the leader
    finally:
        orchestrator.join(timeout=60)
        _reap([impostor, *workers])
    _assert_reference(odd_checkpoint, got)


@pytest.mark.slow
def test_four_ranks_over_three_hosts_that_dial_in(odd_checkpoint, hosts, monkeypatch):
    """tp 4: ranks 0-1 here, rank 2 and 3 dialling in from two other hosts: transformers' tokens."""
    monkeypatch.setenv("NEURON_CLUSTER_TOKEN", "tp4-token")
    port = _free_port(hosts.leader)
    workers = [_dial_in(hosts, hosts.names[i], port, 2 + i, 4, "tp4-token") for i in range(2)]
    try:
        with LLM(str(odd_checkpoint), tensor_parallel_size=4, device="cpu", dtype="float32",
                 hosts=f"localhost:2,{hosts.names[0]}:1,{hosts.names[1]}:1", worker_launcher="connect",
                 cluster_address=hosts.leader, cluster_port=port) as llm:
            got = _greedy(llm)
        assert [w.wait(timeout=30) for w in workers] == [0, 0]
    finally:
        _reap(workers)
    _assert_reference(odd_checkpoint, got)


@pytest.mark.slow
def test_a_frozen_host_is_found_by_heartbeats(odd_checkpoint, hosts, monkeypatch):
    """A dialled-in rank (no process here to look at) stopped between steps: the heartbeat it no
    longer answers marks the ranks failed within about a second, and they serve again once the
    orchestrator has started a fresh rank."""
    import time

    token = "hb-token"
    monkeypatch.setenv("NEURON_CLUSTER_TOKEN", token)
    monkeypatch.setenv("NEURON_LIVENESS_INTERVAL_S", "0.3")
    monkeypatch.setenv("NEURON_HEARTBEAT_TIMEOUT_S", "1")
    port = _free_port(hosts.leader)
    workers = [_dial_in(hosts, hosts.names[0], port, 1, 2, token)]
    try:
        with LLM(str(odd_checkpoint), tensor_parallel_size=2, device="cpu", dtype="float32",
                 hosts=f"localhost:1,{hosts.names[0]}:1", worker_launcher="connect", cluster_address=hosts.leader,
                 cluster_port=port) as llm:
            first = _greedy(llm)
            time.sleep(1.0)  # idle: heartbeats come and are answered
            assert llm.engine.failure is None
            os.kill(workers[0].pid, signal.SIGSTOP)
            stopped = time.monotonic()
            wait_until(lambda: llm.engine.failure is not None, 10, "the frozen rank was not noticed")
            assert time.monotonic() - stopped < 0.3 + 1 + 2  # an interval, the heartbeat's timeout, slack
            assert "heartbeat" in llm.engine.failure
            workers[0].kill()
            workers[0].wait(timeout=30)
            workers.append(_dial_in(hosts, hosts.names[0], port, 1, 2, token))
            assert _greedy(llm) == first
    finally:
        _reap(workers)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["launched", "dialled-in"])
@pytest.mark.parametrize("fault", ["kill", "link"])
def test_a_served_stream_ends_within_the_deadline_and_the_server_serves_again(odd_checkpoint, hosts, monkeypatch,
                                                                             fault, mode):
    """`neuron serve` with rank 1 on another host, started by the launcher or dialling in: mid-stream
    the remote rank is killed, or its link taken down; the stream ends with an error within the
    deadline, and once the link is back (and, for a killed rank that dialled in, the orchestrator
    has started another) the server has rebuilt its ranks and answers as before."""
    import json as jsonlib
    import time

    import httpx
    from server_harness import LiveServer, real_engine

    monkeypatch.setenv("NEURON_COLLECTIVE_TIMEOUT_S", "3")
    monkeypatch.setenv("NEURON_TP_STEP_TIMEOUT_S", "6")
    monkeypatch.setenv("NEURON_RECOVERY_BACKOFF_S", "0.5")
    monkeypatch.setenv("NEURON_RECOVERY_ATTEMPTS", "20")
    link = hosts.links[0]
    workers, extra = [], {}
    if mode == "dialled-in":
        monkeypatch.setenv("NEURON_CLUSTER_TOKEN", "served-token")
        extra["cluster_port"] = port = _free_port(hosts.leader)
        workers.append(_dial_in(hosts, hosts.names[0], port, 1, 2, "served-token"))
    engine = real_engine(str(odd_checkpoint), 2, hosts=f"localhost:1,{hosts.names[0]}:1",
                         worker_launcher=LAUNCHER if mode == "launched" else "connect", cluster_address=hosts.leader,
                         **extra)
    # no tokenizer, no text: logprobs make every token a chunk of its own (and name its id)
    body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0.0, "logprobs": 0}
    short = {"model": "m", "prompt": PROMPTS[1], "max_tokens": 8, "ignore_eos": True, "temperature": 0.0,
             "logprobs": 0, "return_tokens_as_token_ids": True}

    def token_ids(logprobs: dict) -> list[int]:
        return [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]

    with LiveServer(engine) as server:
        server.wait_ready()
        url = f"{server.base_url}/completions"
        short["model"] = body["model"] = httpx.get(f"{server.base_url}/models").json()["data"][0]["id"]
        before = token_ids(httpx.post(url, json=short, timeout=60).json()["choices"][0]["logprobs"])
        assert before == reference_greedy(odd_checkpoint, PROMPTS[1], 8)[0]
        events, cut_at = [], None
        try:
            with httpx.stream("POST", url, json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    events.append(jsonlib.loads(line[6:]))
                    if len(events) == 5:
                        cut_at = time.monotonic()
                        if fault == "kill":
                            victim = workers[0] if workers else engine_pool(engine).workers[0].proc
                            os.kill(victim.pid, signal.SIGKILL)
                        else:
                            _ip("link", "set", link, "down")
            ended = time.monotonic()
        finally:
            _ip("link", "set", link, "up")
        try:
            assert cut_at is not None and ended - cut_at < 6 + 5  # the step deadline, some slack
            assert "error" in events[-1] and len(events) < 400
            if workers and fault == "kill":  # the orchestrator starts another
                workers.append(_dial_in(hosts, hosts.names[0], port, 1, 2, "served-token"))
            wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 200, 60,
                       "the server did not recover")
            assert token_ids(httpx.post(url, json=short, timeout=60).json()["choices"][0]["logprobs"]) == before
        finally:
            _reap(workers)


def engine_pool(engine):
    """The worker pool behind a served AsyncEngine."""
    return engine.engine.executor.pool


def test_the_launcher_prefixes_only_ranks_on_other_hosts(odd_checkpoint):
    """No namespace needed: the commands the pool would run."""
    from dataclasses import replace

    from checkpoints import executor_config

    from neuron.executor.executor import Executor

    # tp 3 is more than this model splits into: the commands are all this test looks at
    cfg = replace(executor_config(odd_checkpoint, max_model_len=64), tp=3, hosts="localhost:2,gpu7:1",
                  worker_launcher="srun -w {host} --ntasks 1", cluster_address="10.0.0.5")
    ex = Executor(cfg)
    try:
        assert ex.cluster_address == "10.0.0.5"
        local, remote = ex._worker_cmd(1, 3, "cpu"), ex._worker_cmd(2, 3, "cpu")
        assert local[1:3] == ["-m", "neuron"]
        assert remote[:4] == ["srun", "-w", "gpu7", "--ntasks"] and remote[5:] == local[:5] + ["2"] + local[6:]
    finally:
        ex.shutdown()


@pytest.mark.slow
def test_one_host_listens_on_loopback_only(odd_checkpoint):
    """tp 2 on this machine: every socket the leader and its worker listen on (the rendezvous,
    gloo's pairs) is bound to 127.0.0.1."""
    if shutil.which("ss") is None:
        pytest.skip("needs iproute2's ss to list listening sockets")
    with LLM(str(odd_checkpoint), tensor_parallel_size=2, device="cpu", dtype="float32") as llm:
        _greedy(llm, 2)
        pids = {os.getpid()} | {w.proc.pid for w in llm.engine.executor.pool.workers}
        lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    ours = [ln.split()[3] for ln in lines if any(f"pid={pid}," in ln for pid in pids)]
    assert ours and all(addr.startswith(f"{LOOPBACK}:") for addr in ours), ours


def test_placements_parse_and_refuse():
    assert parse_hosts(None, 3) == Placement.local(3)
    p = parse_hosts("localhost:2, gpu2:2", 4)
    assert p.hosts == ("localhost", "localhost", "gpu2", "gpu2") and p.remote
    assert [p.local_index(r) for r in range(4)] == [0, 1, 0, 1]
    assert not parse_hosts("localhost:2", 2).remote
    for spec, tp, message in (("gpu2:2", 2, "the first entry must be the leader's own host"),
                              ("localhost:1,gpu2:2", 2, "places 3 rank"),
                              ("localhost:0", 1, "not HOST or HOST:N"),
                              ("localhost,gpu$(rm -rf x)", 2, "not HOST or HOST:N")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("$", r"\$")):
            parse_hosts(spec, tp)


def test_a_host_file(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# rank 0 here\nlocalhost:1\ngpu2:2  gpu3\n")
    assert parse_hosts(str(f), 4).hosts == ("localhost", "gpu2", "gpu2", "gpu3")


def test_only_loopback_unless_a_cluster_address_is_set():
    local, remote = Placement.local(2), parse_hosts("localhost:1,gpu2:1", 2)
    assert cluster_address(None, None, local) == LOOPBACK
    with pytest.raises(ConfigError, match="need the leader's address"):
        cluster_address(None, None, remote)
    with pytest.raises(ConfigError, match="0.0.0.0 would listen on every interface"):
        cluster_address("0.0.0.0", None, remote)
    with pytest.raises(ConfigError, match="IPv4 address"):
        cluster_address("gpu1", None, remote)
    assert cluster_address(None, "lo", remote) == LOOPBACK  # an interface's own address
    with pytest.raises(ConfigError, match="no IPv4 address"):
        interface_address("nosuchif0")
    assert interface_of(LOOPBACK) == "lo" and address_towards(LOOPBACK) == LOOPBACK


def test_a_launcher_template_must_parse():
    assert launcher_argv("kubectl exec -i {host} --", "pod-1") == ["kubectl", "exec", "-i", "pod-1", "--"]
    with pytest.raises(ConfigError, match="worker-launcher"):
        launcher_argv("ssh '{host}", "a")
