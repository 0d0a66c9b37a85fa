"""Running children (parent side): this script as a child in its own session, under a deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench_gpu.py"


class ChildRun:
    """What one child left: its figures by name, and why any figure it did not leave is missing."""

    def __init__(self, figures: dict, failure: str):
        self.figures, self.failure = figures, failure

    def get(self, name: str) -> tuple[float | None, dict, str | None]:
        """(value, detail, error) of one figure."""
        fig = self.figures.get(name)
        if fig is None:
            return None, {}, self.failure or "the child left no figure"
        if "error" in fig:
            return None, {}, fig["error"]
        return fig["value"], fig["detail"], None


def run_child(kind: str, label: str, spec: dict, work: Path, deadline_s: float) -> ChildRun:
    """Run this script as a `kind` child in its own session (so a timeout kills it with everything it
    started) and read back what it wrote."""
    spec_path, result_path, log_path = (work / f"{label}{ext}" for ext in (".spec.json", ".result.json", ".log"))
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(SCRIPT), "_child", kind, str(spec_path), str(result_path)]
    print(f"bench_gpu: {label} (log {log_path})", file=sys.stderr, flush=True)
    failure, t0 = "", time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            code = proc.wait(timeout=deadline_s)
            if code != 0:
                failure = f"exit code {code}: {last_error_line(log_path)}"
        except subprocess.TimeoutExpired:
            kill_session(proc)
            failure = f"timed out after {deadline_s:g} s"
        except BaseException:  # Ctrl-C reaches only the parent: the child has its own session
            kill_session(proc)
            raise
    figures = json.loads(result_path.read_text()) if result_path.is_file() else {}
    print(f"bench_gpu: {label} took {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    if failure or any("error" in f for f in figures.values()):
        tail = "".join(f"\n  {ln}" for ln in log_path.read_text(errors="replace").splitlines()[-15:])
        print(f"bench_gpu: {label}: {failure or 'a figure failed'}{tail}", file=sys.stderr)
    return ChildRun(figures, failure)


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the process and its session, while it still runs (a reaped leader's id may be reused)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def last_error_line(log_path: Path) -> str:
    """The exception line of a traceback: the last line that is not indented."""
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    for line in reversed(lines):
        if not line.startswith((" ", "\t")):
            return line[:240]
    return "no output"
