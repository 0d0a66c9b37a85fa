"""Where the ranks run: on the leader's machine, or on other hosts started through a launcher.

`--hosts` lists the hosts in rank order with how many ranks each runs (`localhost:2,gpu2:2`: ranks
0-1 here, rank 0 in the leader's process, ranks 2-3 on gpu2), or names a file of such entries,
one or more per line. A rank on another host is started by the launcher command (`ssh -T {host}`
by default; `srun -w {host} ...`, `kubectl exec -i {host} --`, `ip netns exec {host}` work alike)
followed by the usual `neuron --worker ...`: its stdin and stdout travel through the launcher
unchanged, and it takes the GPU of its index among its host's ranks.

Ranks on other hosts meet at the leader's cluster address: `--cluster-address` (an IPv4 address of
this host) or `--cluster-interface` (the interface whose address it is). Without ranks elsewhere
it is 127.0.0.1, so nothing listens beyond loopback unless configured; an unspecified address
(0.0.0.0) is refused. Each rank's collectives (gloo's pair sockets) use its own address on the
route to the leader's, which it logs at start.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
import socket
from dataclasses import dataclass
from pathlib import Path

from neuron.distributed.net import LOOPBACK, interface_address
from neuron.errors import ConfigError

DIAL_IN = "connect"  # --worker-launcher connect: ranks on other hosts are started elsewhere and dial in
_HOST = re.compile(r"^[A-Za-z0-9_.-]+$")  # a name or address; it goes into the launcher's arguments


def _local_names() -> set[str]:
    names = {"localhost", LOOPBACK, "::1"}
    for name in (socket.gethostname(), socket.getfqdn()):
        names.add(name)
        names.add(name.split(".")[0])
    return names


@dataclass(frozen=True, slots=True)
class Placement:
    hosts: tuple[str, ...]  # per rank; hosts[0] is the leader's own

    @classmethod
    def local(cls, tp: int) -> "Placement":
        return cls(("localhost",) * tp)

    def is_local(self, rank: int) -> bool:
        return self.hosts[rank] == self.hosts[0]

    @property
    def elsewhere(self) -> set[int]:
        """The ranks on other hosts than the leader's."""
        return {r for r in range(len(self.hosts)) if not self.is_local(r)}

    @property
    def remote(self) -> bool:
        """Some rank runs on another host."""
        return bool(self.elsewhere)

    def local_index(self, rank: int) -> int:
        """The rank's index among its host's ranks (which GPU of that host it takes)."""
        return self.hosts[:rank].count(self.hosts[rank])


def parse_hosts(spec: str | None, tp: int) -> Placement:
    """`--hosts` (entries `HOST[:N]`, comma- or line-separated, or a file of them) as a Placement of
    `tp` ranks; None: every rank on this machine."""
    if not spec:
        return Placement.local(tp)
    text = spec
    path = Path(spec).expanduser()
    if "," not in spec and path.is_file():
        text = path.read_text()
    entries = [e for line in text.splitlines() for e in re.split(r"[,\s]+", line.split("#", 1)[0]) if e]
    hosts: list[str] = []
    for entry in entries:
        host, _, count = entry.rpartition(":") if ":" in entry else (entry, "", "1")
        if not _HOST.match(host) or not count.isdigit() or int(count) < 1:
            raise ConfigError(f"--hosts: {entry!r} is not HOST or HOST:N (N ranks on HOST, at least 1)")
        hosts += [host] * int(count)
    if not hosts:
        raise ConfigError("--hosts lists no host")
    if hosts[0] not in _local_names():
        raise ConfigError(f"--hosts: the first entry must be the leader's own host (localhost or "
                          f"{socket.gethostname()}), got {hosts[0]!r}: rank 0 runs in the leader's process")
    if len(hosts) != tp:
        raise ConfigError(f"--hosts places {len(hosts)} rank(s) but the tensor-parallel size is {tp}")
    first = hosts[0]
    return Placement(tuple("localhost" if h == first else h for h in hosts))


def cluster_address(address: str | None, interface: str | None, placement: Placement) -> str:
    """The address the leader listens on for the ranks' rendezvous."""
    if interface:
        found = interface_address(interface)
        if address and address != found:
            raise ConfigError(f"--cluster-address {address} is not the address of --cluster-interface "
                              f"{interface} ({found})")
        return found
    if address:
        try:
            ip = ipaddress.IPv4Address(address)
        except ValueError:
            raise ConfigError(f"--cluster-address must be an IPv4 address of this host, got {address!r}") from None
        if ip.is_unspecified:
            raise ConfigError("--cluster-address 0.0.0.0 would listen on every interface: name the one "
                              "address the other hosts reach")
        return address
    if placement.remote:
        raise ConfigError("ranks on other hosts need the leader's address they reach: set --cluster-address "
                          "or --cluster-interface")
    return LOOPBACK


def launcher_argv(template: str, host: str) -> list[str]:
    """The launcher command for `host`, to which `neuron --worker ...` is appended."""
    try:
        argv = shlex.split(template.replace("{host}", host))
    except ValueError as exc:
        raise ConfigError(f"--worker-launcher {template!r}: {exc}") from None
    if not argv:
        raise ConfigError("--worker-launcher is empty")
    return argv
