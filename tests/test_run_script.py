"""`./run`, the two-command start: it installs on its first call and nothing on the next ones;
serving installs what neuron needs to run, `./run test` the test tools on top; torch's CPU build
comes from a local wheel when pip's find-links hold one, and an index it cannot reach fails fast."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "VENV_DIR": sys.prefix}  # the environment these tests run in
    return subprocess.run(["bash", str(ROOT / "run"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _functions(script: str, venv: Path, env: dict[str, str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """`script` run in a bash that sourced ./run (its functions, none of its steps) with VENV_DIR=venv,
    on a machine without an NVIDIA GPU whatever this one has."""
    prelude = f'source {ROOT / "run"}\nhas_gpu() {{ false; }}\n'
    return subprocess.run(["bash", "-c", prelude + script], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "VENV_DIR": str(venv), **(env or {})}, timeout=timeout)


def test_without_a_command_it_prints_its_usage():
    out = _run()
    assert out.returncode == 2
    assert "./run serve --tp 2" in out.stdout and "./run test" in out.stdout


def test_the_suite_runs_as_two_processes_on_two_cores_and_as_one_beside_a_gpu(tmp_path):
    def processes(setup: str, env: dict[str, str] | None = None) -> str:
        out = _functions(setup + "\ntest_processes", tmp_path, env={"NEURON_TEST_PROCESSES": "", **(env or {})})
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert processes("getconf() { echo 2; }") == "2"
    assert processes("getconf() { echo 64; }") == "2"
    assert processes("getconf() { echo 1; }") == "0"
    assert processes("getconf() { echo 8; }; has_gpu() { true; }") == "0"  # its tests measure the device's memory
    assert processes("getconf() { echo 8; }", env={"NEURON_TEST_PROCESSES": "5"}) == "5"


@pytest.mark.slow
def test_the_second_call_installs_nothing():
    first = _run("install")  # installs only if this environment was not made by ./run
    assert first.returncode == 0, first.stderr
    second = _run("install", timeout=60)
    assert second.returncode == 0
    assert second.stderr == ""  # no "installing ..." and no pip output: nothing was installed
    version = _run("--version", timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("neuron ")


def test_serving_installs_no_test_tools_and_the_test_command_adds_them(tmp_path):
    # A venv whose python is this one (torch present, so no torch step); pip, the kernel build and
    # the bytecode compilation only record what they were asked.
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name, body in (("python", f'exec {sys.executable} "$@"'), ("neuron", "exit 0")):
        (venv / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (venv / "bin" / name).chmod(0o755)
    calls = tmp_path / "calls"
    stubs = "".join(f'{name}() {{ echo "{name} $*" >> {calls}; }}\n'
                    for name in ("pip", "build_kernels", "compile_modules"))
    steps = f"cuda_extra() {{ :; }}\nensure_runtime\necho serving >> {calls}\nensure_runtime\n" \
            "ensure_test_tools\nensure_test_tools\n"
    out = _functions(stubs + steps, venv)
    assert out.returncode == 0, out.stderr
    assert calls.read_text().splitlines() == [
        "pip install --no-compile -e .",  # serving: neuron and its dependencies, no extra
        "build_kernels ",
        "serving",  # a second call installs nothing
        "pip install -e .[test]",  # the test tools, once
        "compile_modules ",
    ]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_name(r) for r in project["dependencies"]}
    test_tools = {_name(r) for r in project["optional-dependencies"]["test"]}
    assert {"pytest", "triton", "openai", "accelerate"} <= test_tools and not test_tools & runtime


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()


def _fake_torch_wheel(folder: Path) -> Path:
    """A wheel named like torch's CPU build, holding one module: what pip's find-links would offer."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "torch-2.13.0+cpu-py3-none-any.whl"
    info = "torch-2.13.0+cpu.dist-info"
    files = {
        "torch/__init__.py": '__version__ = "2.13.0+cpu"\n',
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\nRequires-Dist: sympy\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)
        whl.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]))
    return path


def _isolated_pip(find_links: Path, **extra: str) -> dict[str, str]:
    """pip with no configuration file and only `find_links` as local wheels."""
    return {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(find_links), "PIP_NO_INPUT": "1", **extra}


@pytest.fixture
def bare_venv(tmp_path) -> Path:
    """A new venv with the pip its Python bundles, as ./run makes one."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    return venv


def _installed(venv: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, sysconfig\n"
            "for d in m.distributions(path=[sysconfig.get_path('purelib')]): print(d.metadata['Name'], d.version)")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True)
    return dict(line.split() for line in out.stdout.splitlines())


@pytest.mark.slow
def test_a_torch_wheel_in_find_links_is_installed_alone_without_the_network(tmp_path, bare_venv):
    _fake_torch_wheel(tmp_path / "wheels")
    # Any index reached would fail the install: the wheel must come from find-links.
    env = _isolated_pip(tmp_path / "wheels", TORCH_CPU_INDEX="http://127.0.0.1:1/", PIP_INDEX_URL="http://127.0.0.1:1/")
    out = _functions("install_torch", bare_venv, env)
    assert out.returncode == 0, out.stderr
    assert "torch 2.13.0 (CPU) installed from a local wheel (pip's find-links)" in out.stderr
    assert "downloading" not in out.stderr and "WARNING" not in out.stderr
    installed = _installed(bare_venv)
    assert installed["torch"] == "2.13.0+cpu"
    assert set(installed) - {"pip", "setuptools"} == {"torch"}  # alone: its dependencies come with neuron's


@pytest.mark.slow
def test_without_a_local_wheel_an_unreachable_index_fails_in_seconds_saying_what_to_do(tmp_path, bare_venv):
    (tmp_path / "wheels").mkdir()
    env = _isolated_pip(tmp_path / "wheels", TORCH_CPU_INDEX="http://127.0.0.1:1/")
    started = time.monotonic()
    out = _functions("install_torch", bare_venv, env)
    assert out.returncode == 1
    assert time.monotonic() - started < 60  # pip's own defaults here: 5 retries of 15 s each and more
    assert "no local wheel of torch 2.13.0 (CPU) in pip's find-links: downloading it from http://127.0.0.1:1/" \
        in out.stderr
    assert "could not install torch: put torch-2.13.0+cpu's wheel in a folder of pip's find-links" in out.stderr
