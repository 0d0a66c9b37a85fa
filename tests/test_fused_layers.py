"""A CPU fp32 step's decoder layers in one C++ call (neuron/layers/cpu_decoder.py) against the
same layers run one kernel call at a time from Python: the same logits and the same KV blocks, bit
for bit, at tp 1 and 2, for each dense family (Qwen3's q/k norms, Llama's biases on every
projection, Qwen2's on q/k/v) and with quantized projections, across prefill and decode; steps the
C loop does not take and weights it does not multiply keep the Python layers."""

from __future__ import annotations

import ctypes
import json

import pytest
import torch
from checkpoints import BASE, ODD, build_checkpoint, generate_greedy

from neuron.distributed import shm
from neuron.distributed.comm import Communicator, NativeAllReduce, SingleRank
from neuron.distributed.shm import CommFailure
from neuron.layers import cpu_decoder, cpu_ops
from neuron.layers.kernels import Kernels
from neuron.layers.paged_attention import build_metadata
from neuron.layers.quantized import QuantizedWeight, StackedWeight, pack_nibbles, quantize_fp8, quantize_int8
from neuron.models import build_model
from neuron.models.loader import CheckpointReader, safetensors_files
from neuron.step import SeqStep
from neuron.worker.model_runner import ModelRunner
from neuron.worker.step_input import BlockTables

pytestmark = pytest.mark.skipif(cpu_decoder.library() is None or cpu_ops.library() is None,
                                reason="the CPU kernels could not be built here")

BLOCK = 4
MAX_LEN = 128
SLOTS = 5
FUSED, LAYERED = Kernels(), Kernels(fused_layers=False)  # LAYERED: what NEURON_NO_FUSED_LAYERS builds


def _build_family(path, family: str, **overrides):
    import transformers

    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
    config_cls, model_cls = (getattr(transformers, n) for n in names[family])
    torch.manual_seed(3)
    model_cls(config_cls(**{**BASE, **overrides})).eval().save_pretrained(path, safe_serialization=True)
    return path


CASES = {
    "qwen3-odd": lambda path: build_checkpoint(path, seed=1, **ODD),
    "llama-bias": lambda path: _build_family(path, "llama", attention_bias=True, mlp_bias=True),
    "qwen2-odd": lambda path: _build_family(path, "qwen2", **{k: v for k, v in ODD.items() if k != "rope_theta"}),
}


@pytest.fixture(scope="module", params=list(CASES))
def fused_checkpoint(request, tmp_path_factory):
    return CASES[request.param](tmp_path_factory.mktemp(request.param))


def _runner(path, kernels: Kernels, comm: Communicator | None = None,
            kv_dtype: torch.dtype | None = None) -> ModelRunner:
    config = json.loads((path / "config.json").read_text())
    model = build_model(config, comm or SingleRank(), torch.float32, torch.device("cpu"), kernels)
    model.kv_dtype = kv_dtype
    with CheckpointReader(safetensors_files(path)) as r:
        model.load(r)
    blocks = SLOTS * MAX_LEN // BLOCK
    model.allocate(num_blocks=blocks, block_size=BLOCK, max_slots=SLOTS, max_model_len=MAX_LEN)
    return ModelRunner(model, blocks, BlockTables(SLOTS, blocks, BLOCK, MAX_LEN, torch.device("cpu"), True))


@pytest.fixture
def fused_steps(monkeypatch) -> list[int]:
    """The rows of each step the C loop ran; (rows, "head") where it ran the final norm and head
    too, (rows, "tokens") where it also embedded the tokens (run_tokens)."""
    rows, run, run_tokens = [], cpu_decoder.DecoderStack.run, cpu_decoder.DecoderStack.run_tokens

    def counted(self, x, *args, **kwargs):
        out = run(self, x, *args, **kwargs)
        if out is not None:
            rows.append((x.shape[0], "head") if kwargs.get("with_logits") else x.shape[0])
        return out

    def counted_tokens(self, token_ids, *args):
        out = run_tokens(self, token_ids, *args)
        if out is not None:
            rows.append((token_ids.shape[0], "tokens"))
        return out

    monkeypatch.setattr(cpu_decoder.DecoderStack, "run", counted)
    monkeypatch.setattr(cpu_decoder.DecoderStack, "run_tokens", counted_tokens)
    return rows


def _blocks(slot: int) -> list[int]:
    per_slot = MAX_LEN // BLOCK
    return list(range(slot * per_slot, (slot + 1) * per_slot))


def _same_steps(fused: ModelRunner, layered: ModelRunner) -> None:
    """Prefill a lone prompt, then two more in one step (10 rows: the C loop), then one of
    MAX_ROWS + 6 rows (the Python layers) and one of 40 (the C loop, quantized parts past the
    kernels' 32 rows through the panels); decode batches of 3, 1 and 2 across block boundaries: equal
    logits at every step and equal KV pools at the end."""
    prompts = {0: [5, 17, 200, 3], 1: list(range(10, 16)), 2: [7] * 4,
               3: list(range(30, 36 + cpu_decoder.MAX_ROWS)), 4: list(range(100, 140))}
    steps = [[SeqStep(0, prompts[0], 0, _blocks(0), fresh=True)],
             [SeqStep(s, prompts[s], 0, _blocks(s), fresh=True) for s in (1, 2)],
             [SeqStep(3, prompts[3], 0, _blocks(3), fresh=True)],
             [SeqStep(4, prompts[4], 0, _blocks(4), fresh=True)]]
    lengths = {s: len(p) for s, p in prompts.items()}
    for active in ([0, 1, 2], [3], [0, 3], [0, 1, 2], [2]):
        for i in range(3):
            steps.append([SeqStep(s, [(11 * s + 3 * i) % 256], lengths[s]) for s in active])
            for s in active:
                lengths[s] += 1
    for seqs in steps:
        got, expected = fused.step(seqs).logits, layered.step(seqs).logits
        assert torch.equal(got, expected), [s.slot for s in seqs]
    for a, b in zip(fused.model.cache.k + fused.model.cache.v, layered.model.cache.k + layered.model.cache.v):
        assert torch.equal(a, b)


# the prompts' steps end in Python (their last rows' logits); decode steps run from their token
# ids to their logits in C
DECODES = [3, 3, 3, 1, 1, 1, 2, 2, 2, 3, 3, 3, 1, 1, 1]
FUSED_STEPS = [4, 10, 40] + [(n, "tokens") for n in DECODES]
# a plan with quantized projections takes the 40-row step too: past quantized.MAX_KERNEL_ROWS its
# parts go through neuron_qlinear_panels, as quantized.linear sends them
QUANTIZED_STEPS = FUSED_STEPS


def test_one_call_equals_the_python_layers(fused_checkpoint, fused_steps):
    _same_steps(_runner(fused_checkpoint, FUSED), _runner(fused_checkpoint, LAYERED))
    assert fused_steps == FUSED_STEPS


def test_without_the_inputs_a_decode_step_still_ends_with_the_head(fused_checkpoint, fused_steps, monkeypatch):
    """A plan that did not take the embedding (a layout the row lookup does not read) embeds in
    Python and still runs the final norm and head in its call: the same logits."""
    monkeypatch.setattr(cpu_decoder.DecoderStack, "attach_inputs", lambda *a: False)
    _same_steps(_runner(fused_checkpoint, FUSED), _runner(fused_checkpoint, LAYERED))
    assert fused_steps == [4, 10, 40] + [(n, "head") for n in DECODES]


def test_an_embedding_row_out_of_range_is_refused_by_the_one_call(fused_checkpoint):
    """run_tokens checks every id and position against its table before reading it."""
    runner = _runner(fused_checkpoint, FUSED)
    runner.step([SeqStep(0, [5, 17, 200, 3], 0, _blocks(0), fresh=True)])
    stack = runner.model._decoder_stack()
    batch = runner.tables.prepare([SeqStep(0, [7], 4)])
    vocab, length = stack.inputs[0].shape[0], stack.inputs[1].shape[0]
    for ids, positions in (([vocab], [4]), ([-1], [4]), ([7], [length])):
        with pytest.raises(IndexError, match="past the embedding table or a position past the rotary"):
            stack.run_tokens(torch.tensor(ids), torch.tensor(positions), batch.paged)
    assert stack.run_tokens(torch.tensor([7]), torch.tensor([4]), batch.paged).shape == (1, runner.model.config.vocab_size)


class _Rows:
    """A layer's MLP that records how many rows each call brings."""

    def __init__(self, mlp):
        self.mlp, self.rows = mlp, []

    def __call__(self, x, *args):
        self.rows.append(x.shape[0])
        return self.mlp(x, *args)


def test_the_last_layer_runs_the_rows_the_head_reads_alone(fused_checkpoint, monkeypatch):
    """Past storing its keys and values, a step's last layer runs only the rows whose logits are
    returned (each sequence's last token, a speculative step's last few): the first layer sees
    every row, the last one those, in the Python layers and in the C loop alike. The logits are
    those of running every row within float rounding, and the KV blocks are the same bit for bit."""
    pruned, full = _runner(fused_checkpoint, LAYERED), _runner(fused_checkpoint, LAYERED)
    fused = _runner(fused_checkpoint, FUSED)
    first, last = _Rows(pruned.model.layers[0].mlp), _Rows(pruned.model.layers[-1].mlp)
    pruned.model.layers[0].mlp, pruned.model.layers[-1].mlp = first, last
    steps = [[SeqStep(0, list(range(20, 33)), 0, _blocks(0), fresh=True),
              SeqStep(1, [5, 17, 200, 3, 9], 0, _blocks(1), fresh=True)],
             [SeqStep(0, [40], 13), SeqStep(2, list(range(50, 61)), 0, _blocks(2), fresh=True)],
             [SeqStep(1, [7, 8, 9, 10], 5, logits=3), SeqStep(2, [61, 62], 11, logits=2)],
             [SeqStep(3, list(range(60, 60 + cpu_decoder.MAX_ROWS + 6)), 0, _blocks(3), fresh=True)]]
    for seqs in steps:
        with monkeypatch.context() as m:  # every row through every layer
            m.setattr("neuron.models.base.kept_rows", lambda batch: None)
            expected = full.step(seqs).logits
        got, in_c = pruned.step(seqs).logits, fused.step(seqs).logits
        assert torch.equal(got, in_c)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert first.rows == [18, 12, 6, cpu_decoder.MAX_ROWS + 6]
    assert last.rows == [2, 2, 5, 1]
    for a, b in zip(pruned.model.cache.k + pruned.model.cache.v, full.model.cache.k + full.model.cache.v):
        assert torch.equal(a, b)


def _four_bit(w: torch.Tensor) -> QuantizedWeight:
    """W in 4-bit codes with a scale and an offset per 32 inputs (Q4_1's arithmetic)."""
    n, k = w.shape
    groups = w.float().reshape(n, k // 32, 32)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-8)
    codes = torch.round((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15).reshape(n, k)
    return QuantizedWeight(codes=pack_nibbles(codes), k=k, bits=4, group=32, scale=scale, offset=-low, format="q4_1")


def _dense(w) -> torch.Tensor:
    """A layer's fp32 weight as a row-major tensor (the layers hold it as panels)."""
    return w.dequantize() if isinstance(w, cpu_ops.PanelWeight) else w


def _quantize(runner: ModelRunner, layout: str) -> ModelRunner:
    """Every projection, the head and the embedding int8; or, "mixed", q/k/v stacked from a 4-bit
    part (q) and an int8 one (k and v), gate/up, the head and the embedding 4-bit, the output and
    down projections int8; or, "4-bit parts", q, k and v three 4-bit parts and gate and up two (as
    a GGUF file holds them, which the C loop multiplies in one call each), the rest as "mixed"."""
    for layer in runner.model.layers:
        a, m = layer.attn, layer.mlp
        for projection in (a.qkv, a.o_proj, m.gate_up, m.down):
            projection.weight = _dense(projection.weight)
        if layout == "int8":
            a.qkv.weight, m.gate_up.weight = quantize_int8(a.qkv.weight), quantize_int8(m.gate_up.weight)
        elif layout == "mixed":
            q_rows = a.qkv.sizes[0]
            a.qkv.weight = StackedWeight([_four_bit(a.qkv.weight[:q_rows]), quantize_int8(a.qkv.weight[q_rows:])])
            m.gate_up.weight = _four_bit(m.gate_up.weight)
        else:
            a.qkv.weight = StackedWeight([_four_bit(w) for w in a.qkv.weight.split(a.qkv.sizes)])
            m.gate_up.weight = StackedWeight([_four_bit(w) for w in m.gate_up.weight.chunk(2)])
        a.o_proj.weight, m.down.weight = quantize_int8(a.o_proj.weight), quantize_int8(m.down.weight)
    head = runner.model.lm_head  # the output projection too: the C loop's head multiplies it as Python does
    head.weight = quantize_int8(_dense(head.weight)) if layout == "int8" else _four_bit(_dense(head.weight))
    embed = runner.model.embed  # and the table the C loop reads the decode steps' rows from
    embed.weight = quantize_int8(_dense(embed.weight)) if layout == "int8" else _four_bit(_dense(embed.weight))
    return runner


@pytest.mark.parametrize("layout", ["int8", "mixed", "4-bit parts"],
                         ids=["int8", "stacked-4-bit-and-int8", "stacked-4-bit-parts"])
@pytest.mark.parametrize("exact", [False, True], ids=["integer", "exact"])
def test_quantized_projections_in_one_call_equal_the_python_layers(fused_checkpoint, fused_steps, layout, exact):
    """The quantized kernels inside the C loop (the integer-activation one by default, the exact
    one under NEURON_QUANT_EXACT), a projection stacked from two layouts among them, or from parts
    of one layout that the integer kernel multiplies in one call: the Python layers' logits and KV
    blocks, bit for bit."""
    fused = _quantize(_runner(fused_checkpoint, Kernels(quant_exact=exact)), layout)
    layered = _quantize(_runner(fused_checkpoint, Kernels(fused_layers=False, quant_exact=exact)), layout)
    # one call for the parts where the integer kernel multiplies all of them ("mixed": offered for
    # q/k/v, and declined there, its parts' codes differing; test_quant_int.py tests both answers)
    weights = fused.model._decoder_stack().weights
    assert [bool(w.qkv.stack) for w in weights] == [not exact and layout != "int8"] * len(weights)
    assert [bool(w.gate_up.stack) for w in weights] == [not exact and layout == "4-bit parts"] * len(weights)
    _same_steps(fused, layered)
    assert fused_steps == QUANTIZED_STEPS


def test_a_plan_takes_many_rows_where_a_many_row_kernel_takes_every_quantized_part():
    """Steps of up to MAX_ROWS for integer codes (past their kernel's rows through the many-row
    kernel), of up to the kernels' 32 where a part is FP8, which no many-row kernel takes."""
    w = torch.randn(64, 128)
    four_bit = cpu_decoder._parts(FUSED, _four_bit(w), 64, 128)
    assert [bool(p.many) for p in four_bit] == [True] and cpu_decoder._rows_for(four_bit) == cpu_decoder.MAX_ROWS
    fp8 = cpu_decoder._parts(FUSED, quantize_fp8(w), 64, 128)
    assert [bool(p.many) for p in fp8] == [False] and cpu_decoder._rows_for(four_bit + fp8) == 32


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_16_bit_kv_cache_in_one_call_equals_the_python_layers(fused_checkpoint, fused_steps, kv_dtype):
    """An fp32 model's keys and values held in 16 bits (kv_cache_dtype): the C loop rounds them
    into the pool as torch's .to() does in the Python layers, and attends over them widened the
    same way: the same logits and pools, bit for bit."""
    fused = _runner(fused_checkpoint, FUSED, kv_dtype=kv_dtype)
    layered = _runner(fused_checkpoint, LAYERED, kv_dtype=kv_dtype)
    assert {t.dtype for t in fused.model.cache.k + fused.model.cache.v} == {kv_dtype}
    _same_steps(fused, layered)
    assert fused_steps == FUSED_STEPS


@pytest.mark.slow
def test_tp2_one_call_equals_the_python_layers(tmp_path, monkeypatch):
    """Two ranks summing through shared memory inside the C loop: the same greedy tokens and
    logprobs as the Python layers, exactly. Llama with biases on every projection: the row-parallel
    biases are added after the sum (the families' other differences are the same at tp 1)."""
    path = CASES["llama-bias"](tmp_path)
    prompts = [[5, 17, 200, 3], list(range(10, 50)), [7]]
    fused = generate_greedy(path, 2, prompts, 6)
    monkeypatch.setenv("NEURON_NO_FUSED_LAYERS", "1")
    layered = generate_greedy(path, 2, prompts, 6)
    for a, b in zip(fused, layered):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


class _UnmappedSegment(Communicator):
    """Rank 0 of 2 whose all-reduce entry point is handed a segment no rank initialised: the
    shared-memory all-reduce answers BAD_SEGMENT at the first sum."""

    def __init__(self):
        super().__init__(0, 2)
        self.segment, self.abort_word, self.statuses = torch.zeros(4096, dtype=torch.uint8), ctypes.c_uint32(0), []

    def native_all_reduce(self) -> NativeAllReduce:
        return NativeAllReduce(ctypes.cast(shm.library().neuron_shm_all_reduce, ctypes.c_void_p).value,
                               self.segment.data_ptr(), self.segment, self.rank, 1000,
                               ctypes.addressof(self.abort_word), self._fail)

    def _fail(self, status: int) -> None:
        self.statuses.append(status)
        raise CommFailure(f"rank {self.rank}: all-reduce status {status}")


@pytest.mark.skipif(shm.library() is None, reason="the shared-memory all-reduce could not be built here")
def test_a_failed_sum_stops_the_layers_and_raises(tmp_path):
    comm = _UnmappedSegment()
    model = _runner(build_checkpoint(tmp_path, seed=4), FUSED, comm).model
    stack = model._decoder_stack()
    assert stack is not None
    meta = build_metadata([[0]], [0], [1], BLOCK, torch.device("cpu"))
    with pytest.raises(CommFailure):
        stack.run(torch.randn(1, BASE["hidden_size"]), *model.rotary.tables(torch.tensor([0])), meta)
    assert comm.statuses == [3]  # BAD_SEGMENT, from the first layer's first sum


def test_a_weight_no_kernel_takes_keeps_the_python_layers(tmp_path, fused_steps):
    """One projection the C loop would not multiply as the Python layer does (a stacked weight with
    an fp32 part, which F.linear multiplies) and the whole model runs layer by layer; switched
    off, no plan is built."""
    path = build_checkpoint(tmp_path, seed=4)
    runner = _runner(path, FUSED)
    down = runner.model.layers[1].mlp.down
    dense = _dense(down.weight)
    half = dense.shape[0] // 2
    down.weight = StackedWeight([quantize_int8(dense[:half]), dense[half:].clone()])
    logits = runner.step([SeqStep(0, [5, 6, 7], 0, _blocks(0), fresh=True)]).logits
    assert logits.shape == (1, BASE["vocab_size"]) and torch.isfinite(logits).all()
    assert fused_steps == [] and runner.model._decoder_stack() is None
    off = _runner(path, LAYERED)
    off.step([SeqStep(0, [5, 6, 7], 0, _blocks(0), fresh=True)])
    assert fused_steps == [] and off.model._decoder_stack() is None


def test_the_setting_switches_it_off(monkeypatch):
    monkeypatch.setenv("NEURON_NO_FUSED_LAYERS", "1")
    assert not Kernels.from_settings().fused_layers
    monkeypatch.delenv("NEURON_NO_FUSED_LAYERS")
    assert Kernels.from_settings().fused_layers
