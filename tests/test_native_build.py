"""Building neuron's C++ kernels: cached per machine under NEURON_CACHE_DIR, one complete library
when several processes build at once, and a clean fallback (one warning, the PyTorch reference)
when there is no compiler or the build fails."""

import logging
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from neuron.layers import cpu_attention, cpu_ops
from neuron.layers.kernels import Kernels
from neuron.layers.paged_attention import attend, build_metadata, paged_attention_reference
from neuron.utils import native

TINY = 'extern "C" int neuron_answer() { return 42; }\n'

needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler on PATH")


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("NEURON_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fresh_library():
    """cpu_attention.library() looks again (under the test's environment), and again afterwards."""
    cpu_attention.library.cache_clear()
    yield
    cpu_attention.library.cache_clear()


@needs_compiler
def test_build_is_cached_by_source(cache, tmp_path):
    source = tmp_path / "answer.cpp"
    source.write_text(TINY)
    built = native.build(source)
    assert built.parent == cache / "kernels" and built.name.startswith("answer-")
    assert native.load(source, "test").neuron_answer() == 42
    mtime = built.stat().st_mtime_ns
    assert native.build(source) == built and built.stat().st_mtime_ns == mtime  # not compiled again
    source.write_text(TINY.replace("42", "43"))
    assert native.build(source) != built  # a changed source is a new library
    assert native.load(source, "test").neuron_answer() == 43


@needs_compiler
def test_a_changed_header_beside_the_source_is_a_new_library(cache, tmp_path):
    (tmp_path / "answer.h").write_text("inline int answer() { return 42; }\n")
    source = tmp_path / "answer.cpp"
    source.write_text('#include "answer.h"\nextern "C" int neuron_answer() { return answer(); }\n')
    built = native.build(source)
    assert native.load(source, "test").neuron_answer() == 42
    (tmp_path / "answer.h").write_text("inline int answer() { return 43; }\n")
    assert native.build(source) != built
    assert native.load(source, "test").neuron_answer() == 43


def _build_in_child(source: str, queue) -> None:
    queue.put(str(native.build(Path(source))))


@needs_compiler
def test_processes_building_at_once_share_one_library(cache, tmp_path):
    source = tmp_path / "answer.cpp"
    source.write_text(TINY)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    children = [ctx.Process(target=_build_in_child, args=(str(source), queue)) for _ in range(3)]
    for child in children:
        child.start()
    paths = {queue.get(timeout=120) for _ in children}
    for child in children:
        child.join(timeout=30)
    assert len(paths) == 1
    assert sorted(p.name for p in (cache / "kernels").iterdir() if p.suffix == ".so") == [Path(*paths).name]


def test_a_missing_compiler_falls_back_to_the_reference(cache, monkeypatch, fresh_library, caplog):
    monkeypatch.setenv("NEURON_CXX", "/nonexistent/g++")
    with caplog.at_level(logging.WARNING, logger="neuron"):
        assert cpu_attention.library() is None
        q, k_pool, v_pool = torch.randn(3, 4, 16), torch.randn(2, 32, 16), torch.randn(2, 32, 16)
        meta = build_metadata([[1], [0]], [0, 4], [2, 1], 16, "cpu")
        out = attend(Kernels(), q, k_pool, v_pool, meta)
    assert torch.equal(out, paged_attention_reference(q, k_pool, v_pool, meta, 0.25))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "falls back to the PyTorch reference" in warnings[0] and "/nonexistent/g++" in warnings[0]
    assert not (cache / "kernels").exists() or not any((cache / "kernels").glob("*.so"))


@needs_compiler
def test_a_failed_build_names_the_error_and_leaves_nothing(cache, tmp_path, caplog):
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++\n")
    with caplog.at_level(logging.WARNING, logger="neuron"):
        assert native.load(source, "broken falls back") is None
    assert "broken falls back" in caplog.text and "broken.cpp" in caplog.text
    assert [p.name for p in (cache / "kernels").iterdir() if not p.name.endswith(".lock")] == []


@needs_compiler
def test_the_command_builds_several_at_once_without_torch_and_names_a_failure(cache, tmp_path):
    good, broken = tmp_path / "answer.cpp", tmp_path / "broken.cpp"
    good.write_text(TINY)
    broken.write_text("this is not C++\n")
    code = ("import sys; from neuron.utils import native; code = native.main(sys.argv[1:]); "
            "sys.exit(3 if 'torch' in sys.modules else code)")
    out = subprocess.run([sys.executable, "-c", code, str(broken), str(good)], capture_output=True, text=True,
                         env={**os.environ, "NEURON_CACHE_DIR": str(cache)}, timeout=300)
    assert out.returncode == 1  # not 3: torch was never imported
    assert out.stdout.splitlines() == [str(native.library_path(good, native.compiler()))]
    assert out.stderr.startswith(f"{broken}: ") and "failed on broken.cpp" in out.stderr


def test_no_compiler_on_path_is_reported(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("NEURON_CXX", raising=False)
    assert native.compiler() is None
    with pytest.raises(native.BuildFailed, match="no C\\+\\+ compiler on PATH"):
        native.build(cpu_attention.SOURCE)


@needs_compiler
def test_a_cpu_rank_builds_its_kernels_while_loading_not_in_its_first_step(cache, tiny_checkpoint):
    """With an empty kernel cache (a machine's first run, or a fresh NEURON_CACHE_DIR) the build
    takes seconds: it happens in load_shard, before any step, whose deadline would otherwise count
    it (a rank once missed a 3 s step deadline compiling there). That includes the decoder loop's
    library, which the first step's plan asks for."""
    from checkpoints import shard_spec

    from neuron.layers import cpu_decoder, cpu_ops
    from neuron.rpc import protocol as p
    from neuron.worker.worker import Worker

    kernels = (cpu_attention, cpu_ops, cpu_decoder)
    for kernel in kernels:
        kernel.library.cache_clear()
    rank = Worker(0, 1)
    try:
        rank.execute(p.LoadShard(seq=1, model_id="m", shard=shard_spec(tiny_checkpoint, max_num_seqs=1,
                                                                       max_model_len=32, max_num_batched_tokens=32)))
        assert [kernel.library.cache_info().currsize for kernel in kernels] == [1, 1, 1]
        built = sorted(f.name.split("-")[0] for f in (cache / "kernels").glob("*.so"))
        assert built == ["cpu_decoder", "cpu_ops", "paged_attention_cpu"]
    finally:
        rank.close()
        for kernel in kernels:
            kernel.library.cache_clear()


@needs_compiler
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="reads x86 instructions")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump on PATH")
def test_the_attention_kernel_keeps_its_prefetches():
    """The decode path asks for each next tile's keys and values (into L2) while the current one
    computes. GCC's dead-code elimination once removed every such __builtin_prefetch from the
    library, so that none ran while the comments said they did."""
    code = subprocess.run(["objdump", "-d", str(native.build(cpu_attention.SOURCE))], capture_output=True,
                          text=True, check=True).stdout
    assert code.count("prefetcht1") >= 4


def _avx2_assembly(*sources: Path) -> list[str]:
    """Each source compiled as the library is, for a CPU without AVX-512, to assembly; the
    compilers run side by side."""
    flags = [f for f in native.FLAGS if f != "-shared"]
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"{i}.s" for i in range(len(sources))]
        procs = [subprocess.Popen([native.compiler(), *flags, "-mno-avx512f", "-S", "-o", str(out), str(source)],
                                  stderr=subprocess.PIPE, text=True) for source, out in zip(sources, outs)]
        errors = [proc.communicate(timeout=native.BUILD_TIMEOUT_S)[1] for proc in procs]
        assert [proc.returncode for proc in procs] == [0] * len(procs), errors
        return [out.read_text() for out in outs]


def _function(assembly: str, prefix: str) -> list[list[str]]:
    """The basic blocks (lines from one label to the next) of the first function whose symbol
    starts with `prefix`."""
    lines = assembly.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(prefix) and line.endswith(":")), None)
    assert start is not None, f"no function {prefix}... in the assembly"
    end = next(i for i in range(start, len(lines)) if ".cfi_endproc" in lines[i])
    blocks: list[list[str]] = [[]]
    for line in lines[start:end]:
        if line.startswith(".L") and line.endswith(":"):
            blocks.append([])
        blocks[-1].append(line)
    return blocks


@needs_compiler
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="reads x86 instructions")
def test_an_avx2_build_keeps_its_hot_loops_in_vector_registers():
    """Built without AVX-512 (16 vector registers), two loops once ran far below the FMA peak: the
    panels' many-row tile kept its accumulators on the stack (the read-ahead's tests inside the loop
    left no room), and the softmax's exponentials ran one lane at a time (GCC did not vectorise the
    scalar 2^x's selects). Each is checked in the assembly: the tile's loop touches no stack slot,
    and the blocked softmax converts whole vectors to integers."""
    ops_code, attention_code = _avx2_assembly(cpu_ops.SOURCE, cpu_attention.SOURCE)
    ops = _function(ops_code, "_ZN12_GLOBAL__N_110panel_loopILi6ELb0ELb0E")
    block = max(ops, key=lambda block: sum("vfmadd" in line for line in block))
    loop = block[: next(i for i, line in enumerate(block) if line.startswith("\tj")) + 1]  # to its branch back
    assert sum("vfmadd" in line for line in loop) == 12  # 6 rows x 2 vectors of the panel
    assert not [line for line in loop if "(%rsp)" in line or "(%rbp)" in line]
    attention = _function(attention_code, "_ZN12_GLOBAL__N_119attend_item_blockedIffLi64E")
    assert any("vcvttps2dq" in line and "%ymm" in line for block in attention for line in block)


@pytest.fixture
def tiny_checkpoint(tmp_path):
    from checkpoints import build_checkpoint

    return build_checkpoint(tmp_path / "tiny", seed=3)
