"""CPU linear layers through oneDNN on the row-major weight: equal to F.linear up to fp32 summation
order for steps of many rows, with no copy of the weight kept; neuron's own kernel for a few rows
(test_cpu_ops.py); F.linear when switched off and off CPU fp32."""

import pytest
import torch
import torch.nn.functional as F

from neuron.layers import cpu_linear, cpu_ops
from neuron.layers.kernels import Kernels


class Owner:
    """A layer to cpu_linear: its model's kernels."""

    def __init__(self, kernels: Kernels = Kernels()):
        self.kernels = kernels


@pytest.fixture
def data():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(64, 256, generator=gen), torch.randn(384, 256, generator=gen), torch.randn(384, generator=gen)


def _calls(monkeypatch) -> list[tuple[int, torch.Tensor]]:
    """The rows and the weight of each oneDNN call, from now on."""
    seen = []
    mkldnn = torch.ops.mkldnn

    class Ops:
        @staticmethod
        def _linear_pointwise(inp, weight, *args):
            seen.append((inp.shape[0], weight))
            return mkldnn._linear_pointwise(inp, weight, *args)

    monkeypatch.setattr(torch.ops, "mkldnn", Ops)
    return seen


def test_many_rows_match_f_linear_on_the_weight_itself(data, monkeypatch):
    _, w, b = data
    rows = cpu_ops.MAX_LINEAR_ROWS + 64  # more than neuron's kernel takes
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    owner = Owner()
    seen = _calls(monkeypatch)
    torch.testing.assert_close(cpu_linear.linear(owner, x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    assert [(n, weight is w) for n, weight in seen] == [(rows, True)]  # no packed copy of it
    assert vars(owner) == {"kernels": owner.kernels}  # nor one kept on the layer
    strided = torch.randn(rows, 300)[:, :256]
    torch.testing.assert_close(cpu_linear.linear(owner, strided, w), F.linear(strided, w), atol=1e-4, rtol=1e-5)


def test_few_rows_and_half_precision_stay_off_onednn(data, monkeypatch):
    x, w, b = data
    seen = _calls(monkeypatch)
    few = x[: cpu_linear.MIN_ROWS - 1]
    torch.testing.assert_close(cpu_linear.linear(Owner(), few, w, b), F.linear(few, w, b), atol=1e-4, rtol=1e-5)
    half = x.bfloat16(), w.bfloat16()
    assert torch.equal(cpu_linear.linear(Owner(), *half), F.linear(*half))
    assert seen == []


def test_switched_off(data, monkeypatch):
    monkeypatch.setenv("NEURON_NO_ONEDNN", "1")
    _, w, b = data
    x = torch.randn(cpu_ops.MAX_LINEAR_ROWS + 64, 256, generator=torch.Generator().manual_seed(2))
    seen = _calls(monkeypatch)
    assert torch.equal(cpu_linear.linear(Owner(Kernels.from_settings()), x, w, b), F.linear(x, w, b))
    assert seen == []


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


def test_steps_below_the_padded_rows_share_one_onednn_primitive(data, monkeypatch):
    """Where oneDNN takes steps of fewer than PADDED_ROWS rows (the small-batch kernel off), it
    sees them padded to PADDED_ROWS rows (one cached primitive for all those sizes), a step above
    to one of the padded sizes, and the caller the rows it sent."""
    x, w, b = data
    owner = Owner(Kernels(cpu_ops=False))
    seen = _calls(monkeypatch)
    for rows in range(1, cpu_linear.PADDED_ROWS + 2):
        got = cpu_linear.linear(owner, x[:rows], w, b)
        assert got.shape == (rows, w.shape[0])
        torch.testing.assert_close(got, F.linear(x[:rows], w, b), atol=1e-4, rtol=1e-5)
    assert {rows for rows, _ in seen} == {cpu_linear.PADDED_ROWS, 2 * cpu_linear.PADDED_ROWS}
    assert cpu_ops.MAX_LINEAR_ROWS >= cpu_linear.PADDED_ROWS  # with the kernel on, oneDNN sees no padding
