"""CPU linear layers through oneDNN with prepacked weights: equal to F.linear up to fp32 summation
order for steps of many rows, neuron's own kernel for a few rows (test_cpu_ops.py), F.linear
when switched off and off CPU fp32."""

import pytest
import torch
import torch.nn.functional as F

from neuron.layers import cpu_linear
from neuron.layers.kernels import Kernels


class Owner:
    """A layer to cpu_linear: its model's kernels, and where its packed weight is kept."""

    def __init__(self, kernels: Kernels = Kernels()):
        self.kernels = kernels


@pytest.fixture
def data():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(64, 256, generator=gen), torch.randn(384, 256, generator=gen), torch.randn(384, generator=gen)


def test_many_rows_match_f_linear_and_pack_once(data):
    x, w, b = data
    owner = Owner()
    torch.testing.assert_close(cpu_linear.linear(owner, x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    packed = owner._onednn
    assert packed[0] is w and packed[1] is not None
    cpu_linear.linear(owner, x, w)
    assert owner._onednn is packed  # not packed again
    other = w.clone()
    torch.testing.assert_close(cpu_linear.linear(owner, x, other), F.linear(x, other), atol=1e-4, rtol=1e-5)
    assert owner._onednn[0] is other  # a replaced weight is packed afresh


def test_few_rows_and_half_precision_are_not_packed(data):
    x, w, b = data
    owner = Owner()
    few = x[: cpu_linear.MIN_ROWS - 1]
    torch.testing.assert_close(cpu_linear.linear(owner, few, w, b), F.linear(few, w, b), atol=1e-4, rtol=1e-5)
    half = x.bfloat16(), w.bfloat16()
    assert torch.equal(cpu_linear.linear(owner, *half), F.linear(*half))
    assert not hasattr(owner, "_onednn")


def test_switched_off(data, monkeypatch):
    monkeypatch.setenv("NEURON_NO_ONEDNN", "1")
    x, w, b = data
    owner = Owner(Kernels.from_settings())
    assert torch.equal(cpu_linear.linear(owner, x, w, b), F.linear(x, w, b))
    assert owner._onednn == (w, None)


def test_step_sizes_are_padded_to_a_few_sizes_with_little_padding():
    """oneDNN keeps a primitive per step size it sees, and each costs memory: every step size up to
    8,192 rows maps to one of at most 64 sizes, none less than the rows, none padding more than 15
    rows or an eighth of the step."""
    sizes = {cpu_linear.padded_rows(rows) for rows in range(1, 8193)}
    assert len(sizes) <= 64
    for rows in range(1, 8193):
        padded = cpu_linear.padded_rows(rows)
        assert padded >= rows and padded % 16 == 0
        assert padded - rows <= max(15, rows // 8)


def test_steps_of_a_few_rows_share_one_padded_onednn_primitive(data, monkeypatch):
    """Between the small-batch kernel's rows and PADDED_ROWS, oneDNN sees the step padded to
    PADDED_ROWS rows (one cached primitive for all those sizes), above it one of the padded sizes,
    and the caller gets the rows it sent."""
    x, w, b = data
    owner = Owner()
    seen = []
    mkldnn = torch.ops.mkldnn

    class Ops:
        _reorder_linear_weight = mkldnn._reorder_linear_weight

        @staticmethod
        def _linear_pointwise(inp, *args):
            seen.append(inp.shape[0])
            return mkldnn._linear_pointwise(inp, *args)

    monkeypatch.setattr(torch.ops, "mkldnn", Ops)
    for rows in range(cpu_linear.MIN_ROWS, cpu_linear.PADDED_ROWS + 2):
        got = cpu_linear.linear(owner, x[:rows], w, b)
        assert got.shape == (rows, w.shape[0])
        torch.testing.assert_close(got, F.linear(x[:rows], w, b), atol=1e-4, rtol=1e-5)
    assert set(seen) == {cpu_linear.PADDED_ROWS, 2 * cpu_linear.PADDED_ROWS}
