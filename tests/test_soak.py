"""A short soak (scripts/soak.py): 64 concurrent clients mixing streaming, non-streaming and abandoned
requests against `neuron serve --tp 2` with fewer places than clients; every request ends complete
or with a clean 503, abandoned ones leave the engine, memory and open files do not grow, and SIGTERM
stops it all cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from caches import fresh_cache

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "soak.py"


@pytest.mark.slow
def test_short_soak(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(SCRIPT), "--clients", "64", "--requests", "150", "--max-waiting", "32",
           "--time-limit", "60",
           "--log", str(tmp_path / "server.log"), "--json", str(out)]
    env = {**os.environ, "NEURON_CACHE_DIR": str(fresh_cache(tmp_path / "cache"))}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr + (tmp_path / "server.log").read_text()[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and not report["bad"]
    assert report["requests"] == 150 and report["warmup_requests"] == 64
    outcomes = report["outcomes"].values()
    results = {k: sum(counts.get(k, 0) for counts in outcomes) for k in ("complete", "dropped", "503")}
    assert results["complete"] > 50 and results["dropped"] > 10 and results["503"] > 0
    assert report["exit_code"] == 0 and report["workers_left"] == []
    assert len(report["rss_kib_end"]) == 2  # the leader and its worker were both watched
