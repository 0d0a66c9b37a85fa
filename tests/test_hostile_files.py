"""Hostile model files and configs (tests/hostile_files.py) are refused before they can hurt: each
within 5 s, in one line that names the file, tensor, field or key at fault, with no traceback, the
leader process never dying by a signal and its peak RSS under 1 GiB over all of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from caches import fresh_cache
from checkpoints import build_checkpoint
from hostile_files import cases

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
ROOT = TESTS.parent


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Every case loaded in turn by one leader process: (cases, results by name, the process)."""
    root = tmp_path_factory.mktemp("hostile")
    hf = build_checkpoint(root / "hf")
    all_cases = cases(root, hf)
    lines = "".join(json.dumps({"name": c.name, "model": c.model, "overrides": c.overrides, "tp": c.tp,
                                "extra": c.extra}) + "\n" for c in all_cases)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]),
           "NEURON_CACHE_DIR": str(fresh_cache(tmp_path_factory.mktemp("cache"))), "NEURON_LOG_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, str(TESTS / "hostile_sweep.py")], input=lines, capture_output=True,
                          text=True, env=env, timeout=600)
    results = {}
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        if "start" not in record:
            results[record["name"]] = record
    return all_cases, results, proc


def test_the_leader_survives_every_case(sweep):
    all_cases, results, proc = sweep
    started = [json.loads(line)["start"] for line in proc.stdout.splitlines() if '"start"' in line]
    assert proc.returncode == 0, f"the leader died (code {proc.returncode}) during {started[-1]!r}: {proc.stderr[-2000:]}"
    assert set(results) == {c.name for c in all_cases}


def test_every_case_is_refused_in_one_line_naming_its_cause(sweep):
    all_cases, results, _ = sweep
    wrong = []
    for c in all_cases:
        r = results[c.name]
        if r.get("loaded"):
            wrong.append(f"{c.name}: loaded")
        elif "traceback" in r:
            wrong.append(f"{c.name}: {r['type']} escaped:\n{r['traceback']}")
        elif c.names not in r["error"] or "\n" in r["error"]:
            wrong.append(f"{c.name}: {r['error']!r} does not name {c.names!r} in one line")
        elif r["elapsed"] > 5:
            wrong.append(f"{c.name}: refused after {r['elapsed']:.1f} s")
    assert not wrong, "\n".join(wrong)


def test_no_traceback_reaches_the_user(sweep):
    assert "Traceback" not in sweep[2].stderr, sweep[2].stderr[-3000:]


def test_the_leader_stays_under_1_gib(sweep):
    all_cases, results, _ = sweep
    peaks = [(results[c.name]["maxrss"], c.name) for c in all_cases]
    first_over = next((name for peak, name in peaks if peak >= 2**30), None)
    assert max(peaks)[0] < 2**30, (f"peak RSS {max(peaks)[0] / 2**20:.0f} MiB, first past 1 GiB after {first_over}; "
                                   + ", ".join(f"{name} {peak >> 20}" for peak, name in peaks))
