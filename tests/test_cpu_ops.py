"""The C++ small-batch linear kernel and element-wise passes (neuron/layers/cpu_ops.py) against
their PyTorch references: fp32 to summation order, on shapes with vector tails and strided rows,
on one thread and on several; the dispatch that routes CPU fp32 to them, and only that."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoints import build_checkpoint

from neuron.distributed.comm import SingleRank
from neuron.layers import cpu_linear, cpu_ops, norm
from neuron.layers.kernels import Kernels
from neuron.layers.tensor_parallel import ColumnParallelLinear
from neuron.models import build_model
from neuron.models.loader import CheckpointReader, safetensors_files
from neuron.utils import native_memory

pytestmark = pytest.mark.skipif(cpu_ops.library() is None, reason="the CPU kernels could not be built here")

ON, OFF = Kernels(), Kernels(cpu_ops=False)  # OFF: what NEURON_NO_CPU_OPS builds


class Owner:
    """What a linear layer is to cpu_linear: its model's kernels."""

    def __init__(self, kernels: Kernels = ON):
        self.kernels = kernels


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# (rows, out, in): one row, two, three, four; widths with and without a vector tail; one big enough
# that the threads split the weight rows; outputs that leave a partial tile of rows; from five rows
# up the many-row tiles, with a partial tile of rows of x and of the weight; from sixteen up the
# transposed panels: a partial panel, inputs fewer than a vector, a vector tail, rows that split into
# tiles of several sizes, and the most rows the kernel takes
@pytest.mark.parametrize("m,n,k", [(1, 7, 5), (2, 33, 100), (3, 64, 256), (4, 4096, 1024), (1, 1030, 1027),
                                   (5, 7, 100), (7, 1030, 1027), (15, 96, 64), (16, 33, 100), (29, 65, 7),
                                   (64, 1030, 1027), (201, 40, 48), (cpu_ops.MAX_LINEAR_ROWS, 3072, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(m, n, k, bias):
    gen = _gen(m * n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    torch.testing.assert_close(cpu_ops.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_linear_reads_strided_rows():
    """x as a slice of a wider tensor and W as rows of a bigger matrix (a merged projection's part)."""
    gen = _gen(1)
    big = torch.randn(50, 300, generator=gen)
    wide = torch.randn(40, 300, generator=gen)
    for rows in (3, 11, 40):  # the streaming tiles, the many-row ones and the panels
        x, w = wide[:rows, :200], big[10:40, :200]
        torch.testing.assert_close(cpu_ops.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


# (rows, out, in) for a weight held as panels (every fp32 CPU layer's): one row up to a prefill's
# many; outputs that leave a partial panel, fewer inputs than a vector, a vector tail, rows that
# split into tiles of several sizes, and enough work that the threads split the panels
@pytest.mark.parametrize("m,n,k", [(1, 7, 5), (1, 1030, 1027), (2, 33, 100), (4, 4096, 1024), (13, 33, 100),
                                   (14, 96, 64), (29, 65, 7), (64, 1030, 1027), (300, 200, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_weight_held_as_panels_multiplies_as_f_linear(m, n, k, bias):
    gen = _gen(m * n + k + 7)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    held = cpu_ops.PanelWeight(w)
    assert held.shape == (n, k) and torch.equal(held.dequantize(), w)
    torch.testing.assert_close(cpu_ops.panel_linear(x, held, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_panels_take_an_empty_step_and_an_empty_weight():
    held = cpu_ops.PanelWeight(torch.randn(70, 40))
    assert cpu_ops.panel_linear(torch.randn(0, 40), held).shape == (0, 70)
    empty = cpu_ops.PanelWeight(torch.randn(0, 40))
    assert empty.shape == (0, 40) and cpu_ops.panel_linear(torch.randn(3, 40), empty).shape == (3, 0)


def test_a_row_through_panels_has_the_same_bits_in_any_batch():
    """Each output is one sum in input order whatever tile its row lands in (one panel or two at a
    time, 1 to 14 rows): a sequence's numbers do not depend on what else is in its step."""
    gen = _gen(9)
    w, b = torch.randn(1030, 1027, generator=gen), torch.randn(1030, generator=gen)
    held, x = cpu_ops.PanelWeight(w), torch.randn(300, 1027, generator=gen)
    alone = [cpu_ops.panel_linear(x[i:i + 1], held, b) for i in (0, 19, 299)]
    for m in (2, 5, 7, 8, 9, 14, 20, 64, 300):
        y = cpu_ops.panel_linear(x[:m], held, b)
        assert torch.equal(y[:1], alone[0])
        if m > 19:
            assert torch.equal(y[19:20], alone[1])
    assert torch.equal(cpu_ops.panel_linear(x, held, b)[299:], alone[2])


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_threads_share_units_of_panels_by_rows_with_the_same_bits(threads):
    """From 8 rows each thread takes an equal share of the (unit of two panels) x rows: 9 units of
    64 rows on 2 threads split the fifth unit's rows between them. Every thread count gives the
    one-thread bits, and the product is right."""
    gen = _gen(threads)
    w, b = torch.randn(576, 1536, generator=gen), torch.randn(576, generator=gen)  # 9 units on AVX-512
    held, x = cpu_ops.PanelWeight(w), torch.randn(64, 1536, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [cpu_ops.panel_linear(x[:m], held, b) for m in (8, 13, 64)]
        torch.set_num_threads(threads)
        for m, want in zip((8, 13, 64), one):
            assert torch.equal(cpu_ops.panel_linear(x[:m], held, b), want)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one[-1], F.linear(x, w, b), atol=1e-3, rtol=1e-4)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the mappings' flags from Linux's /proc")
def test_panels_lie_on_huge_pages_from_their_first_boundary():
    """A weight of whole 2 MiB pages and a tail: the pages are advised for huge pages (smaps' `hg`),
    the tail for small ones (`nh`), so a panel weight holds no more than its bytes; under 2 MiB it
    is an ordinary tensor."""
    huge = native_memory.HUGE_PAGE
    w = torch.randn(1030, 1027)  # 4.2 MB: two huge pages and a tail
    held = cpu_ops.PanelWeight(w)
    start, nbytes = held.data.data_ptr(), held.data.numel() * 4
    assert start % huge == 0 and torch.equal(held.dequantize(), w)
    assert "hg" in _vm_flags(start) and "hg" in _vm_flags(start + huge)
    assert "nh" in _vm_flags(start + nbytes // huge * huge) and "hg" not in _vm_flags(start + nbytes - 1)
    small = native_memory.huge_page_tensor((1000, 100), torch.float32)
    assert small.shape == (1000, 100) and "hg" not in _vm_flags(small.data_ptr())


def test_panels_read_strided_rows_of_x_and_their_own_rows():
    gen = _gen(2)
    wide = torch.randn(40, 300, generator=gen)
    w = torch.randn(45, 200, generator=gen)
    held = cpu_ops.PanelWeight(w)
    for rows in (1, 11, 40):
        x = wide[:rows, :200]
        torch.testing.assert_close(cpu_ops.panel_linear(x, held), F.linear(x, w), atol=1e-4, rtol=1e-5)
    ids = torch.tensor([0, 44, 31, 32, 7, 7])
    assert torch.equal(held.rows(ids), w[ids]) and held.rows(ids, torch.bfloat16).dtype is torch.bfloat16
    assert torch.equal(held.rows(ids.int()), w[ids])
    columns = torch.randn(200, 64, generator=gen).t()  # a weight whose rows are not contiguous
    torch.testing.assert_close(cpu_ops.panel_linear(wide[:3, :200], cpu_ops.PanelWeight(columns)),
                               F.linear(wide[:3, :200], columns), atol=1e-4, rtol=1e-5)
    for outside in (45, -1):
        with pytest.raises(IndexError, match="45 rows"):
            held.rows(torch.tensor([3, outside]))


def test_the_layers_hold_cpu_fp32_weights_as_panels_and_nothing_else():
    gen = _gen(5)
    w = torch.randn(40, 16, generator=gen)
    layer = ColumnParallelLinear(w, ON)
    assert isinstance(layer.weight, cpu_ops.PanelWeight) and torch.equal(layer.weight.dequantize(), w)
    x = torch.randn(2, 3, 16, generator=gen)  # rows of any shape, as F.linear takes them
    torch.testing.assert_close(layer(x), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert layer(x).shape == (2, 3, 40)
    for kept in (ColumnParallelLinear(w, OFF).weight, ColumnParallelLinear(w.bfloat16(), ON).weight):
        assert isinstance(kept, torch.Tensor)  # switched off, or not fp32: row-major, oneDNN's or F.linear's


def test_a_tied_embedding_reads_the_heads_panels(tmp_path):
    """The head and an embedding tied to it hold one copy, the head's panels, and the lookups read
    the checkpoint's rows from it."""
    path = build_checkpoint(tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert config["tie_word_embeddings"]
    model = build_model(config, SingleRank(), torch.float32, torch.device("cpu"), ON)
    with CheckpointReader(safetensors_files(path)) as r:
        model.load(r)
        table = r.read("model.embed_tokens.weight")
    assert isinstance(model.lm_head.weight, cpu_ops.PanelWeight) and model.embed.weight is model.lm_head.weight
    ids = torch.tensor([[0, 5, config["vocab_size"] - 1]])
    assert torch.equal(model.embed(ids), table[ids])


@pytest.mark.parametrize("rows,width", [(1, 64), (3, 1000), (70, 1024)])  # the last one runs on several threads
def test_rms_norm_and_add_rms_norm(rows, width):
    gen = _gen(rows + width)
    x, delta = torch.randn(rows, width, generator=gen) * 3, torch.randn(rows, width, generator=gen)
    weight = torch.rand(width, generator=gen) + 0.5
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-6), norm.rms_norm_reference(x, weight, 1e-6))
    total, normed = cpu_ops.add_rms_norm(x, delta, weight, 1e-6)
    ref_total, ref_normed = norm.add_rms_norm_reference(x, delta, weight, 1e-6)
    assert torch.equal(total, ref_total)
    torch.testing.assert_close(normed, ref_normed)


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 2, 16), (9, 4, 64), (64, 16, 128)])
def test_norm_rope_on_a_strided_view_of_a_merged_projection(tokens, heads, head_dim):
    """Queries as the leading columns of a qkv projection's output, viewed per head."""
    gen = _gen(tokens * heads)
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = torch.rand(head_dim, generator=gen) + 0.5
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 50
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    expected = norm.apply_rotary(norm.rms_norm_reference(q, weight, 1e-6), cos, sin)
    torch.testing.assert_close(cpu_ops.norm_rope(q, weight, 1e-6, cos, sin), expected)
    k = qkv[:, heads * head_dim: (heads + 1) * head_dim].view(tokens, 1, head_dim)
    for heads_of in (q, k):  # without a norm (Llama's heads): the rotary embedding alone
        torch.testing.assert_close(norm.rope_heads(ON, heads_of, cos, sin), norm.apply_rotary(heads_of, cos, sin))


@pytest.mark.parametrize("rows,width", [(1, 48), (5, 3000), (64, 3072)])
def test_silu_mul_as_halves_of_a_merged_projection(rows, width):
    gen = _gen(rows + width)
    merged = torch.randn(rows, 2 * width, generator=gen) * 5
    merged[0, :6] = torch.tensor([100.0, -100.0, 0.0, -0.0, 88.0, -88.0])  # saturated and zero gates
    gate, up = merged.split(width, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_mul(gate, up), norm.silu_mul_reference(gate, up))


def test_silu_mul_gives_the_same_bits_a_register_at_a_time_and_one_by_one():
    """Whole registers take the vector 2^x and a row's last few values the scalar one: a value's
    result must not depend on where in its row it falls (saturated, zero and infinite gates too)."""
    gen = _gen(7)
    merged = torch.randn(4, 2 * 67, generator=gen) * 30  # 67: whole registers and a tail at any width
    merged[0, :10] = torch.tensor([100.0, -100.0, 0.0, -0.0, 88.0, -88.0, 1e-30, -1e-30, math.inf, -math.inf])
    gate, up = merged.split(67, dim=-1)
    whole = cpu_ops.silu_mul(gate, up)
    one_by_one = torch.cat([cpu_ops.silu_mul(gate[:, i:i + 1], up[:, i:i + 1]) for i in range(67)], dim=1)
    assert torch.equal(whole.view(torch.int32), one_by_one.view(torch.int32))


def test_the_layers_route_cpu_fp32_through_the_kernels(monkeypatch):
    called = []
    for name in ("rms_norm", "norm_rope", "add_rms_norm", "silu_mul", "linear"):
        real = getattr(cpu_ops, name)
        monkeypatch.setattr(cpu_ops, name, lambda *a, _real=real, _name=name: called.append(_name) or _real(*a))
    x, weight = torch.randn(3, 2, 16), torch.rand(16) + 0.5
    cos = sin = torch.ones(3, 1, 16)
    norm.rms_norm(ON, x, weight, 1e-6)
    norm.norm_rope(ON, x, weight, 1e-6, cos, sin)
    norm.rope_heads(ON, x, cos, sin)
    norm.add_rms_norm(ON, x[:, 0], x[:, 1], weight, 1e-6)
    norm.silu_mul(ON, x[:, 0], x[:, 1])
    cpu_linear.linear(Owner(), x[:, 0], torch.randn(8, 16))
    assert called == ["rms_norm", "norm_rope", "norm_rope", "add_rms_norm", "silu_mul", "linear"]
    called.clear()
    half = x.bfloat16(), weight.bfloat16()
    norm.rms_norm(ON, *half, 1e-6)  # other dtypes keep PyTorch
    cpu_linear.linear(Owner(), torch.randn(cpu_ops.MAX_LINEAR_ROWS + 1, 16), torch.randn(8, 16))  # oneDNN's
    assert called == []


def test_switched_off_the_layers_run_pytorch_exactly(monkeypatch):
    monkeypatch.setenv("NEURON_NO_CPU_OPS", "1")
    off = Kernels.from_settings()
    assert off == OFF
    gen = _gen(3)
    x, weight = torch.randn(3, 2, 16, generator=gen), torch.rand(16, generator=gen) + 0.5
    cos, sin = torch.rand(3, 1, 16, generator=gen), torch.rand(3, 1, 16, generator=gen)
    assert torch.equal(norm.rms_norm(off, x, weight, 1e-6), norm.rms_norm_reference(x, weight, 1e-6))
    expected = norm.apply_rotary(norm.rms_norm_reference(x, weight, 1e-6), cos, sin)
    assert torch.equal(norm.norm_rope(off, x, weight, 1e-6, cos, sin), expected)
    assert torch.equal(norm.rope_heads(off, x, cos, sin), norm.apply_rotary(x, cos, sin))
    w = torch.randn(8, 16, generator=gen)
    assert torch.equal(cpu_linear.linear(Owner(off), x[:, 0], w), F.linear(x[:, 0], w))
