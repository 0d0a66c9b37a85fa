"""Which cores each CPU rank runs on (`--cpu-bind`).

Ranks on one host's CPUs share its cores. Left to the scheduler, their OpenMP threads migrate and
meet on the same cores, and a rank's weights drift away from its NUMA node. A rank bound to its own
cores keeps its threads and its memory in one place.

`--cpu-bind` takes what vLLM's VLLM_CPU_OMP_THREADS_BIND takes:
- `auto` (the default): one NUMA node per rank when tp equals the number of nodes that hold cores
  this process may use; otherwise the usable cores split evenly, in order, into tp runs. With fewer
  cores than ranks nothing is bound.
- `nobind`: nothing is bound (the threads of every rank share every core).
- one list per rank, split by `|`: `0-3|4-7`, `0,2|1,3`. Each rank needs at least one core, the lists
  must not overlap, and every core must be one this process may use.

Where the ranks outnumber the cores (nothing bound), their threads take turns on the cores, and a
rank that waits at a collective while another still has work leaves its core idle unless that one
runs on it: the worker ranks' OpenMP threads wait asleep (`OMP_WAIT_POLICY=passive`, `worker_env`)
and each runs a thread per core (worker.set_cpu_threads), so the cores the waiting ranks leave go to
those still working. Rank 0 keeps one thread: it runs in the leader's process, whose OpenMP runtime
read its wait policy when torch was imported.

The topology is read from /sys/devices/system/node; where it is missing the host is one node.
The plan travels to every rank in `init` (protocol.Init.cpu_bind); each binds the thread that runs its
steps (and so the OpenMP threads it starts) to its list.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from neuron.errors import ConfigError
from neuron.utils.openmp import WAIT_POLICY, usable_cpus

NODES = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,8,10-11` as a sorted list of core numbers; ValueError when malformed."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        found = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not found:
            raise ValueError(f"{part!r} is not a core number or a range such as 4-7")
        lo, hi = int(found.group(1)), int(found.group(2) or found.group(1))
        if hi < lo or hi - lo > 4096:
            raise ValueError(f"{part!r} is not a range from a lower to a higher core")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] as `0-3,8`."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def numa_nodes(usable: list[int], root: Path = NODES) -> list[list[int]]:
    """Each NUMA node's usable cores, nodes without any left out; one node where /sys says nothing."""
    nodes = []
    for path in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpu_list((path / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if mine := [c for c in cpus if c in set(usable)]:
            nodes.append(mine)
    return nodes or [list(usable)]


def plan(spec: str, tp: int, usable: list[int] | None = None, nodes: list[list[int]] | None = None) -> list[list[int]]:
    """Each rank's cores (empty lists: nothing bound). Raises ConfigError for a spec it cannot honour."""
    usable = usable_cpus() if usable is None else usable
    spec = spec.strip()
    if spec == "nobind":
        return [[] for _ in range(tp)]
    if spec == "auto":
        nodes = numa_nodes(usable) if nodes is None else nodes
        if len(nodes) == tp and tp > 1:
            return [list(n) for n in nodes]
        if len(usable) < tp:
            return [[] for _ in range(tp)]
        share, extra = divmod(len(usable), tp)
        runs, start = [], 0
        for rank in range(tp):
            size = share + (1 if rank < extra else 0)
            runs.append(list(usable[start:start + size]))
            start += size
        return runs
    lists = spec.split("|")
    if len(lists) != tp:
        raise ConfigError(f"--cpu-bind {spec!r} gives {len(lists)} core list(s) for {tp} rank(s); give one per "
                          "rank, split by | (0-3|4-7), or auto, or nobind")
    runs, seen = [], set()
    for rank, text in enumerate(lists):
        try:
            cpus = parse_cpu_list(text)
        except ValueError as exc:
            raise ConfigError(f"--cpu-bind: rank {rank}'s cores {text!r}: {exc}") from None
        if foreign := [c for c in cpus if c not in set(usable)]:
            raise ConfigError(f"--cpu-bind: rank {rank}'s cores {format_cpu_list(foreign)} are not among the cores "
                              f"this process may use ({format_cpu_list(usable)})")
        if shared := seen.intersection(cpus):
            raise ConfigError(f"--cpu-bind: core(s) {format_cpu_list(sorted(shared))} are given to two ranks")
        seen.update(cpus)
        runs.append(cpus)
    return runs


def describe(runs: list[list[int]]) -> str:
    """The plan as the start-up line prints it: `rank 0: 0-3, rank 1: 4-7`, or `not bound`."""
    if not any(runs):
        return "not bound"
    return ", ".join(f"rank {r}: {format_cpu_list(cpus) if cpus else 'any'}" for r, cpus in enumerate(runs))


def worker_env(tp: int, usable: list[int] | None = None, environ=os.environ) -> dict[str, str]:
    """What the worker ranks' environment adds where the `tp` ranks of one host outnumber the cores
    this process may use: passive OpenMP waits, unless the environment already chooses a policy."""
    usable = usable_cpus() if usable is None else usable
    if len(usable) >= tp or WAIT_POLICY in environ:
        return {}
    return {WAIT_POLICY: "passive"}
