"""The deployment recipes in deploy/: the commands they run parse as neuron's own command line
does and give the configs they mean; the host file places its ranks; the SLURM script is valid
bash. (Running them needs a cluster; tests/test_multihost.py runs the same modes on namespaces.)"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from neuron.entrypoints import serve
from neuron.entrypoints.cli import _parser, worker_parser
from neuron.executor.placement import DIAL_IN, parse_hosts

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _serve_configs(argv: list[str]):
    assert argv[:2] == ["neuron", "serve"], argv
    return serve.configs(_parser().parse_args(argv[1:]))


def test_the_leader_worker_set_leader_and_workers_agree():
    doc = yaml.safe_load((DEPLOY / "lws.yaml").read_text())
    template = doc["spec"]["leaderWorkerTemplate"]
    leader = template["leaderTemplate"]["spec"]["containers"][0]
    worker = template["workerTemplate"]["spec"]["containers"][0]
    argv = shlex.split(leader["args"][0].replace('"$POD_IP"', "10.1.2.3"))
    assert argv[0] == "exec"
    engine, server = _serve_configs(argv[1:])
    assert (engine.tp, engine.hosts, engine.worker_launcher) == (8, "localhost:4,worker:4", DIAL_IN)
    assert engine.cluster_address == "10.1.2.3" and server.host == "0.0.0.0"
    placement = parse_hosts(engine.hosts, engine.tp)
    dialling = [r for r in range(engine.tp) if not placement.is_local(r)]
    # the worker pod's loop, unrolled: one process per GPU, the ranks the leader waits for
    loop = worker["args"][0]
    ranks = []
    for i in range(4):
        body = loop.split(" do ", 1)[1].split(" & done", 1)[0]
        body = body.replace('"$LWS_LEADER_ADDRESS:29600"', "10.1.2.3:29600").replace("$((4 + i))", str(4 + i))
        args = worker_parser().parse_args(shlex.split(body.replace("$i", str(i)))[1:])
        assert args.connect == f"10.1.2.3:{engine.cluster_port}" and args.tp_size == engine.tp
        assert args.device == f"cuda:{placement.local_index(args.rank)}"
        ranks.append(args.rank)
    assert ranks == dialling
    for container in (leader, worker):
        token = {e["name"]: e for e in container["env"]}["NEURON_CLUSTER_TOKEN"]
        assert "secretKeyRef" in token["valueFrom"]


def test_the_host_file_places_eight_ranks():
    placement = parse_hosts(str(DEPLOY / "hosts.example"), 8)
    assert placement.hosts == ("localhost",) * 4 + ("gpu-node-2",) * 4


def test_the_slurm_script_is_valid_bash_and_launches_through_srun():
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    script = (DEPLOY / "slurm.sbatch").read_text()
    subprocess.run(["bash", "-n", str(DEPLOY / "slurm.sbatch")], check=True)
    command = script[script.index("neuron serve"):].replace("\\\n", " ")
    command = command.replace('"$MODEL"', "/m").replace('"localhost:4,${NODES[1]}:4"', "localhost:4,n2:4")
    command = command.replace('"$LEADER_ADDR"', "10.0.0.1")
    engine, _ = _serve_configs(shlex.split(command))
    assert engine.worker_launcher.startswith("srun") and "{host}" in engine.worker_launcher
    assert parse_hosts(engine.hosts, engine.tp).remote and engine.cluster_address == "10.0.0.1"


def test_the_container_serves_the_mounted_model():
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    entry = next(ln for ln in lines if ln.startswith("ENTRYPOINT"))
    argv = yaml.safe_load(entry.split(" ", 1)[1])  # a JSON array
    engine, _ = _serve_configs(argv + ["--tp", "2"])
    assert engine.model == "/model" and engine.tp == 2
