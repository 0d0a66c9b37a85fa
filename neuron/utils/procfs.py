"""Process state from Linux /proc (watchdog, tests, soak). Elsewhere every answer is "unknown"."""

from __future__ import annotations

import os


def state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, T, Z, ...), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'
    except (OSError, IndexError):
        return None
    return fields[0] if fields else None


def parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    """Running or sleeping; a zombie its parent has not reaped yet counts as gone."""
    return state(pid) not in (None, "Z", "X")


def stopped(pid: int) -> bool:
    """Stopped by SIGSTOP or a debugger."""
    return state(pid) in ("T", "t")


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resident_bytes(pid: int | None = None) -> int | None:
    """Bytes of memory the process (this one by default) has resident (VmRSS), None where unknown."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def child_pids(pid: int) -> list[int]:
    """Live processes whose parent is `pid`."""
    entries = os.listdir("/proc") if os.path.isdir("/proc") else []
    return sorted(int(e) for e in entries if e.isdigit() and parent(int(e)) == pid and alive(int(e)))
