"""The settings table: every NEURON_* variable declared once, bad values refused by name, and each
default reaching the engine, server and command-line configs (and the README) from that one place."""

from __future__ import annotations

import re
import runpy
import socket
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from neuron.config import SETTINGS, Settings, load_settings, settings
from neuron.engine.llm_engine import EngineConfig
from neuron.entrypoints import generate, serve
from neuron.entrypoints.cli import run_command
from neuron.entrypoints.openai.app import ServerConfig
from neuron.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
# Variables that belong to the test harness, not to neuron.
HARNESS_ONLY = {"NEURON_MOCK_SCRIPT", "NEURON_TEST_INSTAFAIL", "NEURON_TEST_PROCESSES"}  # read by tests or ./run
# EngineConfig fields and the settings they default to.
ENGINE_FIELDS = {"model": "model", "tp": "tp", "device": "device", "dtype": "dtype", "max_model_len": "max_model_len",
                 "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
                 "prefill_chunk_tokens": "prefill_chunk_tokens", "served_model_name": "served_model_name",
                 "block_size": "kv_block_size", "kv_cache_memory": "kv_cache_memory",
                 "gpu_memory_utilization": "gpu_memory_utilization"}


@pytest.fixture
def clean_env(monkeypatch):
    """No NEURON_* variable set, so every setting is the table's default."""
    for s in SETTINGS.values():
        monkeypatch.delenv(s.env, raising=False)
    return monkeypatch


def _variables_in(*paths: Path) -> set[str]:
    found = set()
    for path in paths:
        files = [path] if path.is_file() else path.rglob("*")
        for f in files:
            if f.suffix in (".py", ".md"):
                found |= set(re.findall(r"NEURON_[A-Z][A-Z0-9_]*[A-Z0-9]", f.read_text()))
    return found


def test_every_variable_used_is_declared():
    declared = {s.env for s in SETTINGS.values()}
    used = _variables_in(ROOT / "neuron", ROOT / "scripts", ROOT / "tests", ROOT / "docs", ROOT / "README.md")
    assert used - declared - HARNESS_ONLY == set()


def test_only_the_config_module_reads_the_environment():
    readers = [f.relative_to(ROOT).as_posix() for f in (ROOT / "neuron").rglob("*.py")
               if re.search(r"environ(\.get)?[\[(]\s*\"NEURON_", f.read_text())]
    assert readers == []


def test_the_table_defaults_pass_their_own_checks():
    for s in SETTINGS.values():
        assert s.check(s.default) == s.default
        assert s.help and s.env == "NEURON_" + s.name.upper()


@pytest.mark.parametrize("env, value, allowed", [
    ("NEURON_PORT", "not-a-port", "an integer in 0..65535"),
    ("NEURON_TP", "0", "an integer >= 1"),
    ("NEURON_GPU_MEMORY_UTILIZATION", "1.5", "a number in (0, 1]"),
    ("NEURON_KEEPALIVE_S", "0", "a number > 0"),
    ("NEURON_TP_STEP_TIMEOUT_S", "nan", "a number > 0"),
    ("NEURON_KV_CACHE_MEMORY", "lots", "a positive byte count"),
    ("NEURON_MAX_LINE_BYTES", "-5", "a positive byte count"),
    ("NEURON_NO_PREFIX_CACHING", "maybe", "1, true, yes or on"),
    ("NEURON_DTYPE", "fp8", "one of auto, float32, bfloat16, float16"),
    ("NEURON_LOG_LEVEL", "loud", "one of debug, info, warning, error"),
])
def test_a_bad_value_names_the_variable_the_value_and_what_is_allowed(env, value, allowed):
    with pytest.raises(ConfigError) as info:
        load_settings({env: value})
    assert str(info.value).startswith(f"{env}: expected {allowed}")
    assert str(info.value).endswith(f"got {value!r}")


def test_values_are_parsed_and_empty_means_unset():
    s = load_settings({"NEURON_KV_CACHE_MEMORY": "4GiB", "NEURON_LOG_LEVEL": "WARNING", "NEURON_TP": " 2 ",
                       "NEURON_NO_PREFIX_CACHING": "yes", "NEURON_API_KEY": "", "NEURON_MAX_BODY_BYTES": "1MiB"})
    assert (s.kv_cache_memory, s.log_level, s.tp, s.no_prefix_caching, s.api_key, s.max_body_bytes) == \
        (4 * 2**30, "warning", 2, True, None, 2**20)
    assert load_settings({}) == Settings()


def test_the_snapshot_is_kept_until_the_environment_changes(clean_env):
    first = settings()
    assert settings() is first
    clean_env.setenv("NEURON_PREFILL_CHUNK_TOKENS", "8")
    assert settings().prefill_chunk_tokens == 8
    clean_env.setenv("NEURON_PREFILL_CHUNK_TOKENS", "zero")
    with pytest.raises(ConfigError, match="NEURON_PREFILL_CHUNK_TOKENS"):
        settings()


def test_defaults_reach_the_engine_and_server_configs(clean_env):
    engine, server = EngineConfig(), ServerConfig()
    assert {f: getattr(engine, f) for f in ENGINE_FIELDS} == {f: SETTINGS[s].default for f, s in ENGINE_FIELDS.items()}
    assert engine.enable_prefix_caching is None  # on wherever the model allows it
    names = [f.name for f in fields(ServerConfig)]
    assert {n: getattr(server, n) for n in names} == {n: SETTINGS[n].default for n in names}


def test_the_environment_and_explicit_values_reach_the_configs(clean_env):
    clean_env.setenv("NEURON_MAX_NUM_SEQS", "5")
    clean_env.setenv("NEURON_NO_PREFIX_CACHING", "1")
    clean_env.setenv("NEURON_SHUTDOWN_GRACE_S", "2.5")
    assert (EngineConfig().max_num_seqs, EngineConfig(max_num_seqs=3).max_num_seqs) == (5, 3)
    assert EngineConfig().enable_prefix_caching is False
    assert ServerConfig().shutdown_grace_s == 2.5


@pytest.mark.parametrize("make, message", [
    (lambda: EngineConfig(tp=0), "tp must be an integer >= 1, got 0"),
    (lambda: EngineConfig(block_size=0), "block_size must be an integer >= 1, got 0"),
    (lambda: EngineConfig(gpu_memory_utilization=0.0), "gpu_memory_utilization must be a number in (0, 1], got 0.0"),
    (lambda: EngineConfig(dtype="fp8"), "dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"),
    (lambda: ServerConfig(port=-1), "port must be an integer in 0..65535, got -1"),
])
def test_explicit_values_are_checked_against_the_table(clean_env, make, message):
    with pytest.raises(ConfigError) as info:
        make()
    assert str(info.value) == message


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        run_command([command, "--help"])
    return capsys.readouterr().out


def _option_blocks(text: str) -> dict[str, str]:
    """Each option's help, keyed by its first flag, with all whitespace removed (argparse wraps
    lines, at hyphens too)."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^  (\S+)", line)
        if head:
            current = head.group(1).rstrip(",")
            blocks[current] = ""
        elif not line.startswith("   "):
            current = None
        if current:
            blocks[current] += re.sub(r"\s+", "", line)
    return blocks


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_shows_each_default_once(command, capsys, clean_env):
    blocks = _option_blocks(_help(command, capsys))
    names = {"serve": serve.OPTIONS, "generate": generate.OPTIONS}[command]
    assert all(block.count("default:") <= 1 for block in blocks.values()), blocks
    for name in ("model", *names):
        s = SETTINGS[name]
        block = blocks["MODEL" if name == "model" else s.flag]
        assert re.sub(r"\s+", "", f"(default: {s.shown()}; {s.env}") in block, name


def test_help_shows_the_table_default_not_the_environment(capsys, clean_env):
    clean_env.setenv("NEURON_MAX_NUM_SEQS", "5")
    assert "(default:16;NEURON_MAX_NUM_SEQS)" in _option_blocks(_help("serve", capsys))["--max-num-seqs"]


def test_serve_refuses_a_bad_variable_before_starting(capsys, clean_env):
    clean_env.setenv("NEURON_MAX_WAITING", "-1")
    assert run_command(["serve"]) == 2
    assert capsys.readouterr().err.strip() == "neuron serve: NEURON_MAX_WAITING: expected an integer >= 0, got '-1'"


def test_readme_lists_every_variable_from_the_table():
    table = runpy.run_path(str(ROOT / "scripts" / "settings_table.py"))
    readme = (ROOT / "README.md").read_text()
    assert table["readme_table"](readme) == table["render"](), "run `python scripts/settings_table.py --write`"
    for s in SETTINGS.values():
        assert readme.count(f"| `{s.env}` |") == 1


def test_config_and_wire_import_without_torch():
    code = "import sys, neuron.config, neuron.rpc.codec; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def _help_sections(text: str) -> dict[str, list[str]]:
    """The flags (and MODEL) under each titled group of a --help text."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if re.fullmatch(r"[a-z][a-z -]*:", line):
            current = sections.setdefault(line[:-1], [])
        elif current is not None and (head := re.match(r"^  (-[-\w]+|MODEL)\b", line)):
            current.append(head.group(1))
    return sections


def test_serve_help_groups_its_options(capsys, clean_env):
    sections = _help_sections(_help("serve", capsys))
    assert list(sections) == ["options", "model", "lora", "parallel", "server", "limits", "multi-host"]
    assert sections["lora"] == ["--lora-modules", "--enable-lora", "--max-loras", "--max-lora-rank",
                                "--allow-runtime-lora-updating"]
    assert sections["options"] == ["-h"]
    assert sections["model"][:2] == ["MODEL", "--served-model-name"] and "--speculative-config" in sections["model"]
    assert sections["parallel"][:2] == ["--tp", "--device"]
    assert sections["server"][:3] == ["--host", "--port", "--api-key"]
    assert "--max-connections" in sections["limits"] and "--header-timeout-s" in sections["limits"]
    assert sections["multi-host"] == ["--hosts", "--worker-launcher", "--cluster-address", "--cluster-interface",
                                      "--cluster-port"]
    listed = [flag for title in list(sections)[1:] for flag in sections[title]]
    assert sorted(listed) == sorted(["MODEL", *(SETTINGS[name].flag for name in serve.OPTIONS)])  # each once


def test_speculative_config_help_lists_every_methods_keys(capsys, clean_env):
    from neuron.engine.spec_decode import COMMON_KEYS, METHOD_KEYS, METHODS, SpeculativeConfig

    keys = [*COMMON_KEYS, *(key for method in METHODS for key in METHOD_KEYS[method])]
    assert sorted(keys) == sorted(SpeculativeConfig.__dataclass_fields__)  # every key belongs to a method or all
    block = _option_blocks(_help("serve", capsys))["--speculative-config"]
    for method in METHODS:
        assert f"{method}:" + ",".join(METHOD_KEYS[method]) in block.replace("model(thedraftcheckpoint)", "model")
    assert "Everymethod:method(ngram,suffixordraft),num_speculative_tokens,disable_by_batch_size;" in block


def test_a_busy_port_is_refused_in_one_line_before_anything_loads(capsys, clean_env):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert run_command(["serve", "--port", str(port)]) == 2
    out = capsys.readouterr()
    assert out.err == (f"neuron serve: 127.0.0.1:{port} is already in use: stop what listens there, or serve on "
                       "another port (--port, NEURON_PORT; --port 0 picks a free one)\n")
    assert out.out == ""


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA torch has CUDA: checked by the next test's fakes")
def test_cuda_on_a_torch_without_it_is_refused_in_one_line(capsys, clean_env):
    assert run_command(["serve", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == (
        f"neuron serve: device cuda: this torch ({torch.__version__}) is a build without CUDA; install a CUDA build "
        "(https://pytorch.org/get-started/locally/; `./run` picks one on a machine with an NVIDIA GPU), or use "
        "--device cpu\n")


@pytest.mark.parametrize("device, message", [
    ("gpu", "device must be cpu, cuda or cuda:N (N a GPU index), got 'gpu'"),
    ("cuda:x", "device must be cpu, cuda or cuda:N (N a GPU index), got 'cuda:x'"),
    ("cuda:2", "device cuda:2: torch sees 2 GPU(s), cuda:0 to cuda:1"),
])
def test_a_device_this_machine_lacks_is_refused_before_any_rank_starts(device, message, monkeypatch, clean_env):
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build with two GPUs visible
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError) as info:
        EngineConfig(device=device)
    assert str(info.value) == message
    assert EngineConfig(device="cuda:1").device == "cuda:1"
