"""Qwen3-MoE: parity with transformers through the offline API at tp 1, 2 and 4, in both expert
layouts (per-expert tensors, as transformers writes them, and fused [E, ...] tensors), the routing
rule, the refusals a parity run cannot reach, and the expert computations (grouped, gather, loop)
against one another and the rule that chooses between them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checkpoints import (
    assert_chunking_changes_nothing,
    assert_matches_reference,
    cached_model,
    generate_greedy,
    greedy_with_logprobs,
)
from safetensors.torch import load_file, save_file
from server_harness import wait_until

from neuron import LLM, SamplingParams
from neuron.distributed.comm import Communicator, SingleRank
from neuron.errors import ConfigError
from neuron.layers.kernels import Kernels
from neuron.layers.moe import GATHER_MAX_PAIRS, Router, SparseMoE, expert_path
from neuron.models import build_model
from neuron.models.qwen3_moe import Qwen3MoeConfig

NEW_TOKENS = 8
LONG = [(i * 37 + 11) % 301 for i in range(40)]  # several 16-token prefill chunks
PROMPTS = [[5, 17, 200, 3], LONG, [7], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]

pytestmark = pytest.mark.usefixtures("small_prefill_chunks")

# An odd expert count (every rank still holds every expert), one dense layer among MoE ones, an
# untied head and a vocabulary no tp divides.
MOE = dict(
    vocab_size=301,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=5,
    num_experts_per_tok=2,
    num_hidden_layers=3,
    mlp_only_layers=[1],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    # Wide, as in checkpoints.py: well-separated logits and router scores, so neither greedy
    # tokens nor expert choices tie for reasons unrelated to correctness.
    initializer_range=0.25,
    eos_token_id=None,
    bos_token_id=None,
)


def _build(path, seed: int, **overrides):
    from transformers import Qwen3MoeConfig as HFConfig
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(HFConfig(**{**MOE, **overrides})).eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "raw_topk"])
def moe_checkpoint(request, tmp_path_factory):
    return _build(tmp_path_factory.mktemp("moe"), seed=3, norm_topk_prob=request.param)


@pytest.fixture(scope="module")
def fused_checkpoint(tmp_path_factory):
    """The same weights as a per-expert checkpoint, experts stacked into transformers' in-memory
    layout: gate_up_proj [E, 2 * inter, hidden] and down_proj [E, hidden, inter]."""
    src = _build(tmp_path_factory.mktemp("moe_src"), seed=4, norm_topk_prob=True)
    dst = tmp_path_factory.mktemp("moe_fused")
    tensors = load_file(src / "model.safetensors")
    for i in (0, 2):
        p = f"model.layers.{i}.mlp.experts"
        per = [{w: tensors.pop(f"{p}.{e}.{w}.weight") for w in ("gate_proj", "up_proj", "down_proj")}
               for e in range(MOE["num_experts"])]
        tensors[f"{p}.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in per])
        tensors[f"{p}.down_proj"] = torch.stack([x["down_proj"] for x in per])
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return src, dst


def _check(outs, reference_path) -> None:
    from transformers import Qwen3MoeForCausalLM

    model = cached_model(Qwen3MoeForCausalLM, reference_path)
    for prompt, got in zip(PROMPTS, outs):
        assert_matches_reference(got, *greedy_with_logprobs(model, prompt, NEW_TOKENS), f"prompt {prompt[:5]}...")
        assert len(got.logprobs) == NEW_TOKENS


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_parity(moe_checkpoint, tp):
    """Unequal prompts in one batch, the long one prefilled over several chunks."""
    _check(generate_greedy(moe_checkpoint, tp, PROMPTS, NEW_TOKENS), moe_checkpoint)


@pytest.fixture(scope="module")
def tp4_checkpoint(tmp_path_factory):
    """MOE with as many KV heads as query heads, so every head count and width divides by 4 (an
    expert is 8 wide per rank)."""
    return _build(tmp_path_factory.mktemp("moe_tp4"), seed=5, norm_topk_prob=True, num_key_value_heads=4)


@pytest.mark.slow
def test_tp4_parity(tp4_checkpoint):
    _check(generate_greedy(tp4_checkpoint, 4, PROMPTS, NEW_TOKENS), tp4_checkpoint)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_fused_layout_parity(fused_checkpoint, tp):
    src, fused = fused_checkpoint
    _check(generate_greedy(fused, tp, PROMPTS, NEW_TOKENS), src)


def test_chunked_prefill_equals_single_shot(moe_checkpoint, monkeypatch):
    assert_chunking_changes_nothing(moe_checkpoint, LONG, 3, monkeypatch)


@pytest.mark.slow
def test_prefix_cache_preemption_and_recovery(fused_checkpoint):
    """At tp 2 under a KV budget too small for the batch: four prompts sharing a 16-token prefix
    reuse its blocks, sequences are preempted and recomputed, and after a worker is killed the
    rebuilt ranks give the same tokens; all of them transformers' tokens."""
    import os
    import signal

    path = fused_checkpoint[0]
    shared = [(i * 13 + 5) % 301 for i in range(16)]
    prompts = [shared + [(i * 7 + j) % 301 for j in range(4 + 2 * i)] for i in range(4)]
    block_bytes = 2 * MOE["num_hidden_layers"] * 1 * MOE["head_dim"] * 4 * 4  # one KV head per rank, fp32
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=64, block_size=4,
             max_num_seqs=4, kv_cache_memory=20 * block_bytes) as llm:
        assert llm.engine.executor.num_kv_blocks == 20
        first = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.prefix_cache_counts()[1] > 0
        victim = llm.engine.executor.pool.workers[0].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        # the liveness monitor notices (within seconds); generate() then rebuilds the ranks first
        wait_until(lambda: llm.engine.failure is not None, 10, "the dead rank was not noticed")
        again = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    from transformers import Qwen3MoeForCausalLM

    model = cached_model(Qwen3MoeForCausalLM, path)
    for prompt, got, rerun in zip(prompts, first, again):
        assert_matches_reference(got, *greedy_with_logprobs(model, prompt, 16), f"prompt {prompt[16:]}")
        assert rerun.token_ids == got.token_ids


def test_sparse_layers_follow_transformers_rule():
    cfg = Qwen3MoeConfig.from_dict(dict(MOE, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [cfg.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]


def test_grouped_experts_equal_a_per_token_loop(moe_checkpoint):
    """The block, by whichever path it chooses, equals each token's own experts summed."""
    from neuron.models.loader import CheckpointReader, safetensors_files

    model = build_model({**MOE, "model_type": "qwen3_moe"}, SingleRank(), torch.float32, torch.device("cpu"),
                        Kernels())
    with CheckpointReader(safetensors_files(moe_checkpoint)) as r:
        block = model.load_mlp(r, 0)
    assert isinstance(block, SparseMoE)
    x = torch.randn(7, MOE["hidden_size"])
    ids, weights = block.router(x)
    expected = torch.zeros_like(x)
    for t in range(7):
        for e, w in zip(ids[t].tolist(), weights[t]):
            gate, up = (block.w_gate_up[e] @ x[t]).split(block.local_inter)
            expected[t] += w * (block.w_down[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)


class _SecondOfTwo(Communicator):
    """Rank 1 of 2, for refusals raised while the model is built, before any collective runs."""

    def __init__(self):
        super().__init__(1, 2)


def test_indivisible_moe_intermediate_size_is_refused():
    config = {**MOE, "model_type": "qwen3_moe", "moe_intermediate_size": 33}
    refusal = r"moe_intermediate_size \(33\) is not divisible by the tensor-parallel size 2"
    with pytest.raises(ConfigError, match=refusal):
        build_model(config, _SecondOfTwo(), torch.float32, torch.device("cpu"), Kernels())
    build_model(config, SingleRank(), torch.float32, torch.device("cpu"), Kernels())  # tp 1 divides everything


def test_missing_expert_fields_are_refused():
    config = {k: v for k, v in MOE.items() if k != "num_experts"}
    with pytest.raises(ConfigError, match="num_local_experts"):
        Qwen3MoeConfig.from_dict(config)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        Qwen3MoeConfig.from_dict(dict(MOE, num_experts_per_tok=6))


def _block(num_experts: int, hidden: int, inter: int, top_k: int = 2, dtype=torch.float32,
           device: str = "cpu") -> SparseMoE:
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).to(dtype=dtype, device=device)

    router = Router(w(num_experts, hidden), top_k, norm_topk_prob=True)
    return SparseMoE(router, w(num_experts, 2 * inter, hidden), w(num_experts, hidden, inter), SingleRank(), Kernels())


def _pair_by_pair(block: SparseMoE, x: torch.Tensor, flat_ids: torch.Tensor) -> torch.Tensor:
    """Each (token, expert) pair's output computed on its own: the definition every path meets."""
    k = flat_ids.numel() // x.shape[0]
    rows = []
    for pair, e in enumerate(flat_ids.tolist()):
        gate, up = (block.w_gate_up[e] @ x[pair // k]).split(block.local_inter)
        rows.append(block.w_down[e] @ (F.silu(gate) * up))
    return torch.stack(rows)


# (tokens, experts, each token's expert ids): which experts get no pair is the point of each case
ROUTES = {
    "one token, 12 of 16 experts empty": (1, 16, [[15, 0, 7, 3]]),
    "first, middle and last experts empty": (5, 8, [[1, 2], [5, 6], [2, 1], [6, 5], [1, 6]]),
    "every pair on one expert": (6, 4, [[2]] * 6),
}


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
def test_expert_paths_equal_the_per_expert_loop(route):
    """grouped_mm is the per-expert loop bit for bit in float32 on CPU; the gathered bmm is equal to
    rounding; both equal the pair-by-pair definition."""
    tokens, experts, ids = route
    block = _block(experts, hidden=32, inter=16)
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(1))
    flat_ids = torch.tensor(ids).flatten()
    loop = block.experts(x, flat_ids, "loop")
    torch.testing.assert_close(loop, _pair_by_pair(block, x, flat_ids), atol=1e-5, rtol=1e-5)
    assert torch.equal(block.experts(x, flat_ids, "grouped"), loop)
    torch.testing.assert_close(block.experts(x, flat_ids, "gather"), loop, atol=1e-6, rtol=1e-5)


def test_grouped_equals_the_loop_over_many_routed_tokens():
    block = _block(16, hidden=64, inter=32, top_k=4)
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(1))
    flat_ids = block.router(x)[0].flatten()
    assert block.path_for(flat_ids.numel()) == "grouped"
    assert torch.equal(block.experts(x, flat_ids, "grouped"), block.experts(x, flat_ids, "loop"))


@pytest.mark.parametrize("hidden, inter", [(30, 16), (32, 6)], ids=["hidden 30", "expert width 6"])
def test_unaligned_widths_fall_back_to_the_loop(hidden, inter):
    """grouped_mm refuses rows that are not a multiple of 16 bytes; the block takes the loop and
    still equals the definition."""
    block = _block(8, hidden, inter)
    x = torch.randn(7, hidden, generator=torch.Generator().manual_seed(1))
    flat_ids = block.router(x)[0].flatten()
    assert block.path_for(flat_ids.numel()) == "loop"
    with pytest.raises(RuntimeError, match="16 bytes"):
        block.experts(x, flat_ids, "grouped")
    torch.testing.assert_close(block.experts(x, flat_ids), _pair_by_pair(block, x, flat_ids), atol=1e-5, rtol=1e-5)


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("pairs, experts, device, dtype, hidden, inter, sm90, path", [
    (64, 16, "cpu", F32, 64, 32, False, "grouped"),
    (16, 128, "cpu", F32, 64, 32, False, "grouped"),  # one pair per 8 experts
    (15, 128, "cpu", F32, 64, 32, False, "loop"),  # fewer: most of grouped_mm's groups are empty
    (64, 16, "cpu", F32, 30, 32, False, "loop"),  # hidden not a multiple of 4 floats
    (64, 16, "cpu", BF16, 64, 12, False, "loop"),  # expert width not a multiple of 8 halves
    (64, 16, "cpu", torch.float64, 64, 32, False, "loop"),  # a dtype grouped_mm lacks
    (8, 128, "cuda", BF16, 64, 32, True, "grouped"),  # sm90: grouped_mm never synchronises
    (4096, 128, "cuda", BF16, 64, 32, True, "grouped"),
    (8, 128, "cuda", BF16, 64, 32, False, "gather"),  # sm80: grouped_mm would read offsets on the host
    (GATHER_MAX_PAIRS, 128, "cuda", F16, 64, 32, True, "gather"),  # fp16 reaches the fallback even on sm90
    (GATHER_MAX_PAIRS + 1, 128, "cuda", F16, 64, 32, True, "grouped"),  # large steps may synchronise
    (8, 128, "cuda", BF16, 60, 32, True, "gather"),
    (4096, 128, "cuda", BF16, 60, 32, True, "loop"),
])
def test_expert_path_rule(pairs, experts, device, dtype, hidden, inter, sm90, path):
    assert expert_path(pairs, experts, device, dtype, hidden, inter, sm90) == path


def test_a_torch_without_grouped_mm_takes_the_loop(monkeypatch):
    monkeypatch.delattr(torch, "_grouped_mm")
    assert expert_path(64, 16, "cpu", F32, 64, 32) == "loop"
    assert expert_path(8, 16, "cuda", BF16, 64, 32, True) == "gather"


def test_a_torch_whose_grouped_mm_has_no_cpu_kernel_takes_the_loop_on_cpu(monkeypatch):
    from neuron.layers import moe

    def cuda_only(*args, **kwargs):  # torch 2.8: the op exists, its CPU dispatch does not
        raise NotImplementedError("Could not run 'aten::_grouped_mm' with arguments from the 'CPU' backend")

    monkeypatch.setattr(torch, "_grouped_mm", cuda_only)
    moe._grouped_mm_on_cpu.cache_clear()
    try:
        assert expert_path(64, 16, "cpu", F32, 64, 32) == "loop"
        assert expert_path(64, 16, "cuda", BF16, 64, 32, True) == "grouped"
    finally:
        moe._grouped_mm_on_cpu.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_decode_steps_neither_synchronise_nor_resist_capture(dtype):
    """On a GPU a decode-sized step never reads back to the host (whatever the dtype and GPU), so
    it replays from a CUDA graph equal to eager."""
    block = _block(64, hidden=128, inter=64, top_k=8, dtype=dtype, device="cuda")
    x, other = (torch.randn(2, 128, dtype=dtype, device="cuda") for _ in range(2))
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = block.partial(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    flat_ids = block.router(x)[0].flatten()
    torch.testing.assert_close(eager, block.partial(x), atol=0, rtol=0)
    reference = (block.experts(x, flat_ids, "loop").view(2, 8, -1) * block.router(x)[1].unsqueeze(-1)).sum(1)
    torch.testing.assert_close(eager, reference, atol=2e-2, rtol=2e-2)
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        block.partial(static)  # warm-up off the capturing stream, as torch asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block.partial(static)
    static.copy_(other)
    graph.replay()
    torch.testing.assert_close(out, block.partial(other), atol=0, rtol=0)
