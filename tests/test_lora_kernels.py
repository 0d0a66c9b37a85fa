"""The Triton kernels for LoRA adapters (neuron/layers/triton_lora.py) against the grouped PyTorch
product they replace on CUDA (`LoraPool.add_grouped`), and their piece of the start-up self-check.
Without a GPU they run in Triton's interpreter on CPU tensors; with one they compile and run on CUDA."""

import dataclasses
import json
import textwrap

import pytest
import torch
from triton_interpret import DEVICE, INTERPRETING, compile_in_a_fresh_process, require_triton  # before Triton loads

from neuron.layers import kernel_cases, kernel_check, lora
from neuron.layers.kernel_check import Widths
from neuron.layers.kernels import Kernels
from neuron.layers.lora import LoraPool, LoraRows

# Relative to the reference's largest value. fp16: a unit or two in the last place (the kernel adds
# its own rounded sum, as the reference does, but sums in another order). bf16 likewise on a GPU;
# Triton's interpreter truncates float32 to bfloat16 where a GPU rounds to nearest: a few truncations.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2 if INTERPRETING else 1.6e-2}
PARTS = {"merged q/k/v": [(0, 24), (24, 8), (32, 8)], "plain": [(0, 40)]}
STEPS = {  # each sequence's adapter slot (-1: the base model) and its rows
    "decode": ([2, -1, 0, 3, 2, -1, 0, 3, -1], [1] * 9),  # three of four slots and the base model's rows
    "prefill": ([1, -1, 2, 1], [63, 5, 1, 2]),  # 71 rows; slot 1's 65 rows take two row tiles
}
IN_FEATURES = 48


@pytest.fixture(scope="module", autouse=True)
def triton_ready():
    require_triton()


def _pool(parts: list[tuple[int, int]], rank: int, dtype: torch.dtype, gen: torch.Generator) -> LoraPool:
    """Four adapters: slots 1 and 3 at half the rank, and each slot leaving one projection out
    where there are several."""
    pool = LoraPool(4, rank, IN_FEATURES, parts, dtype, DEVICE, Kernels())
    for slot in range(4):
        r = rank if slot % 2 == 0 else rank // 2
        for part, (_, size) in enumerate(parts):
            if len(parts) == 1 or part != slot % len(parts):
                a = torch.randn(r, IN_FEATURES, generator=gen) / IN_FEATURES ** 0.5
                b = torch.randn(size, r, generator=gen) / r ** 0.5
                pool.set(slot, part, a.to(DEVICE, dtype), b.to(DEVICE, dtype))
    return pool


def _step(pool: LoraPool, step: str, dtype: torch.dtype, gen: torch.Generator):
    seq_slots, lengths = STEPS[step]
    rows = LoraRows.build(seq_slots, lengths, 4, DEVICE)
    t = sum(lengths)
    x = torch.randn(t, 2 * IN_FEATURES, generator=gen).to(DEVICE, dtype)[:, 5 : 5 + IN_FEATURES]  # rows strided
    y = torch.randn(t, pool.bt.shape[2], generator=gen).to(DEVICE, dtype)
    base = torch.tensor([s < 0 for s, n in zip(seq_slots, lengths) for _ in range(n)], device=DEVICE)
    return rows, x, y, base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("parts", PARTS)
def test_kernel_equals_the_grouped_product(parts, rank, step, dtype):
    gen = torch.Generator().manual_seed(rank)
    pool = _pool(PARTS[parts], rank, dtype, gen)
    rows, x, y, base = _step(pool, step, dtype, gen)
    want = pool.add_grouped(y.clone(), x, rows)
    got = lora.grouped_triton(pool, y.clone(), x, rows)
    assert got.dtype == dtype and got.shape == y.shape
    assert torch.equal(got[base], y[base])  # the base model's rows untouched
    scale = want.float().abs().max().item()
    assert (want.float() - y.float())[~base].abs().amax(dim=1).min().item() > 0.1  # every adapter row moves
    error = (got.float() - want.float()).abs().max().item() / scale
    assert error <= TOLERANCE[dtype], f"differs by {error:.2e} of the largest value"


def test_one_adapter_beside_the_base_and_every_slot_in_order():
    """Two more layouts of a step: one adapter and the base model (one run), and every slot of the
    pool in order (the grouped product skips its gather there)."""
    gen = torch.Generator().manual_seed(3)
    pool = _pool(PARTS["merged q/k/v"], 8, torch.float32, gen)
    for seq_slots, lengths in (([-1, 3, -1], [2, 3, 1]), ([0, 1, 2, 3], [2, 1, 3, 1])):
        rows = LoraRows.build(seq_slots, lengths, 4, DEVICE)
        x = torch.randn(sum(lengths), IN_FEATURES, generator=gen).to(DEVICE)
        y = torch.randn(sum(lengths), 40, generator=gen).to(DEVICE)
        torch.testing.assert_close(lora.grouped_triton(pool, y.clone(), x, rows), pool.add_grouped(y.clone(), x, rows),
                                   atol=1e-5, rtol=1e-5)


# ---- the self-check's piece ----

WIDTHS = Widths(hidden=48, heads=4, kv_heads=2, head_dim=16, intermediate=40)


def _others() -> dict:
    """Every other piece's reference in its kernel's place (their kernels are tested elsewhere)."""
    from test_kernel_check import references

    return references()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_self_check_passes_the_kernel(dtype):
    cases = kernel_cases.cases(DEVICE, dtype, WIDTHS)["lora"]
    assert [name for name, _, _ in cases] == [
        "LoRA, q/k/v, decode", "LoRA, q/k/v, prefill beside decodes", "LoRA, down, decode",
        "LoRA, down, prefill beside decodes"]
    assert kernel_check.check(DEVICE, dtype, WIDTHS, _others() | {"lora": kernel_cases.kernels()["lora"]}) == {}


def test_a_wrong_or_failing_kernel_makes_the_piece_fall_back_alone(monkeypatch):
    def next_adapter(pool, y, x, rows):  # each run multiplied by its neighbour's matrices
        return lora.grouped_triton(pool, y.clone(), x, dataclasses.replace(rows, slots=rows.slots.roll(1)))

    def raises(pool, y, x, rows):
        raise RuntimeError("triton.runtime.errors.OutOfResources: out of resource: shared memory")

    wrong = kernel_check.check(DEVICE, torch.float32, WIDTHS, _others() | {"lora": next_adapter})
    assert list(wrong) == ["lora"]
    assert wrong["lora"].startswith("LoRA, q/k/v, decode: differs from the reference by ")
    failing = kernel_check.check(DEVICE, torch.float32, WIDTHS, _others() | {"lora": raises})
    assert failing == {"lora": "LoRA, q/k/v, decode: RuntimeError: triton.runtime.errors.OutOfResources: out of "
                               "resource: shared memory"}
    kernels = Kernels.from_settings(wrong)
    assert not kernels.triton("lora") and kernels.triton("quant_linear")
    assert kernels.verdict()["lora"] == f"reference: {wrong['lora']}"
    monkeypatch.setenv("NEURON_KERNELS", "reference")
    assert not Kernels.from_settings().triton("lora")


@pytest.mark.gpu
def test_add_to_runs_the_kernel_on_cuda_only_once_trusted(monkeypatch):
    """A mixed step's `add_to` on CUDA runs the kernel; a piece the self-check failed, or
    NEURON_KERNELS=reference, runs the grouped product; a step of one adapter, two plain products."""
    calls = []
    kernel = lora.grouped_triton
    monkeypatch.setattr(lora, "grouped_triton", lambda *a: calls.append(1) or kernel(*a))
    gen = torch.Generator().manual_seed(4)
    trusted = _pool(PARTS["merged q/k/v"], 16, torch.bfloat16, gen)
    rows, x, y, _ = _step(trusted, "decode", torch.bfloat16, gen)
    want = trusted.add_grouped(y.clone(), x, rows)
    got = trusted.add_to(y.clone(), x, rows)
    assert calls == [1]
    error = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
    assert error <= TOLERANCE[torch.bfloat16]
    failed = Kernels.from_settings({"lora": "rank 0: NaN or inf in the output"})
    for kernels in (failed, dataclasses.replace(Kernels(), forced="reference")):
        trusted.kernels = kernels
        assert torch.equal(trusted.add_to(y.clone(), x, rows), want)
    trusted.kernels = Kernels()
    trusted.add_to(y.clone(), x, LoraRows.build([2, 2], [3, 1], 4, DEVICE))
    assert calls == [1]


COMPILE = textwrap.dedent("""
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from neuron.layers.triton_lora import lora_expand_kernel, lora_shrink_kernel

    def shared(kernel, dtype, capability, constexprs):
        tensors = ("x_ptr", "a_ptr", "h_ptr", "bt_ptr", "y_ptr")
        signature = {name: "constexpr" if name in constexprs else "*" + (dtype if name in tensors else "i64")
                     if name.endswith("_ptr") else "i32" for name in kernel.arg_names}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32))
        assert compiled.asm["cubin"]
        return compiled.metadata.shared

    out = []
    for capability in (80, 90, 100):
        for dtype in ("fp32", "bf16", "fp16"):
            for block in (16, 64):  # a decode tile and a prefill tile, as grouped_triton picks
                ieee = dtype == "fp32"
                out.append([capability, dtype, block, "shrink", shared(lora_shrink_kernel, dtype, capability, dict(
                    IEEE=ieee, BLOCK_M=block, BLOCK_W=block, BLOCK_K=64))])
                out.append([capability, dtype, block, "expand", shared(lora_expand_kernel, dtype, capability, dict(
                    PARTS=3, IEEE=ieee, BLOCK_M=block, BLOCK_N=64, BLOCK_R=64))])
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_kernels_compile_for_every_supported_gpu():
    """The interpreter runs Python, which accepts code the GPU compiler refuses (an early return, a
    loop bound computed in the kernel): compile both kernels to cubin for sm_80, sm_90 and sm_100 in
    every dtype and both tiles the runtime picks, no GPU needed, and check their shared memory
    against each card family's limit (a tile over it would fail there with OutOfResources)."""
    from neuron.layers.paged_attention import SHARED_MEMORY

    run = compile_in_a_fresh_process(COMPILE, timeout=600)
    family = {80: (80, 86, 89, 120), 90: (90,), 100: (100,)}
    over = [(cc, dtype, block, kernel, size) for built, dtype, block, kernel, size in
            json.loads(run.stdout.splitlines()[-1]) for cc in family[built] if size > SHARED_MEMORY[cc]]
    assert over == []
