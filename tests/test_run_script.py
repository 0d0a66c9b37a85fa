"""`./run`, the two-command start: it installs on its first call and nothing on the next ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "VENV_DIR": sys.prefix}  # the environment these tests run in
    return subprocess.run(["bash", str(ROOT / "run"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_without_a_command_it_prints_its_usage():
    out = _run()
    assert out.returncode == 2
    assert "./run serve --tp 2" in out.stdout and "./run test" in out.stdout


@pytest.mark.slow
def test_the_second_call_installs_nothing():
    first = _run("install")  # installs only if this environment was not made by ./run
    assert first.returncode == 0, first.stderr
    second = _run("install", timeout=60)
    assert second.returncode == 0
    assert second.stderr == ""  # no "installing ..." and no pip output: nothing was installed
    version = _run("--version", timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("neuron ")
