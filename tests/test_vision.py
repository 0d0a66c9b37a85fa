"""Qwen3.5 with images: the pieces against transformers (preprocessing, resize rule, multimodal
positions, the vision tower), then greedy parity through the offline API at tp 1 and 2 with zero,
one and two images, a long prompt prefilled in chunks with an image across chunk boundaries, a
second checkpoint shaped differently, preemption, and the guards that refuse bad images before
any device work."""

from __future__ import annotations

import base64
import io
import math

import numpy as np
import pytest
import torch
from checkpoints import cached_model, shard_spec
from test_qwen3_5 import MULTIMODAL_TEXT
from vision_checkpoint import (
    assert_image_parity,
    build_vision_checkpoint,
    checkpoint_config,
    image_data_uri,
    image_prompt,
    image_reference,
    reference_pixels,
    vision_spec,
)

from neuron import LLM, SamplingParams
from neuron.engine.llm_engine import RequestError
from neuron.models.loader import CheckpointReader, safetensors_files
from neuron.models.qwen3_5_vision import VisionTower
from neuron.multimodal.image import (
    ImageError,
    check_image,
    expand_placeholders,
    image_spans,
    mrope_positions,
    preprocess,
    smart_resize,
    vision_activation_bytes,
)
from neuron.rpc import protocol as p
from neuron.step import StepImage
from neuron.worker.worker import Worker

NEW_TOKENS = 6

# Shaped unlike the main checkpoint: three layers (full attention first), six heads over two KV
# heads, half-width rotary with even M-RoPE sections, a wider linear-attention value head, a
# two-block vision tower with three heads, 2-pixel patches and a 5x5 position grid.
ODD_TEXT = dict(
    MULTIMODAL_TEXT,
    hidden_size=96,
    intermediate_size=80,
    num_hidden_layers=3,
    layer_types=["full_attention", "linear_attention", "linear_attention"],
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=24,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=3,
    rope_parameters={"rope_type": "default", "rope_theta": 5e4, "partial_rotary_factor": 0.5,
                     "mrope_section": [2, 2, 2], "mrope_interleaved": True},
)
ODD_VISION = dict(depth=2, hidden_size=48, intermediate_size=40, num_heads=3, patch_size=2, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=96, num_position_embeddings=25)
ODD_PREPROCESSOR = {"patch_size": 2, "temporal_patch_size": 2, "merge_size": 2,
                    "size": {"shortest_edge": 64, "longest_edge": 1024},
                    "image_mean": [0.48, 0.46, 0.41], "image_std": [0.27, 0.26, 0.28]}


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return build_vision_checkpoint(tmp_path_factory.mktemp("vision"), seed=11)


@pytest.fixture(scope="module")
def odd_vl_checkpoint(tmp_path_factory):
    return build_vision_checkpoint(tmp_path_factory.mktemp("vision_odd"), seed=5, text=ODD_TEXT, vision=ODD_VISION,
                                   preprocessor=ODD_PREPROCESSOR)


def _png(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# ---- the pieces ----


@pytest.mark.parametrize("height,width", [(3, 3), (17, 9), (20, 28), (100, 64), (5, 400), (61, 61)])
def test_smart_resize_matches_transformers(height, width):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    for factor, lo, hi in [(8, 256, 4096), (32, 65536, 16777216), (4, 64, 1024)]:
        assert smart_resize(height, width, factor, lo, hi) == reference(height, width, factor, lo, hi)


def test_preprocessing_matches_transformers_processor(vl_checkpoint):
    from PIL import Image

    rng = np.random.default_rng(0)
    rgba = Image.fromarray(rng.integers(0, 256, (30, 22, 4), dtype=np.uint8), "RGBA")
    gray = Image.fromarray(rng.integers(0, 256, (12, 40), dtype=np.uint8), "L")
    uris = [image_data_uri(20, 28, 1), image_data_uri(150, 90, 2), _png(rgba), _png(gray), image_data_uri(3, 5, 3)]
    spec = vision_spec(vl_checkpoint)
    ref_pixels, ref_grids = reference_pixels(uris)
    mine = [preprocess(u, spec) for u in uris]
    assert [list(g) for _, g in mine] == ref_grids.tolist()
    assert [check_image(u, spec).grid for u in uris] == [g for _, g in mine]
    torch.testing.assert_close(torch.cat([x for x, _ in mine]), ref_pixels, rtol=0, atol=1e-6)


def test_positions_match_transformers_rope_index(vl_checkpoint):
    from transformers import Qwen3_5ForConditionalGeneration

    spec = vision_spec(vl_checkpoint)
    uris = [image_data_uri(20, 28, 1), image_data_uri(40, 16, 2)]
    images = [check_image(u, spec) for u in uris]
    ids = expand_placeholders(image_prompt(vl_checkpoint, [5, 6, 7], None, [8], None, [9, 10, 11, 12]),
                              spec.image_token_id, images)
    spans = image_spans(ids, spec.image_token_id, [i.num_tokens for i in images])
    positions, shift = mrope_positions(len(ids), spans, [i.grid for i in images], spec.merge_size)
    model = cached_model(Qwen3_5ForConditionalGeneration, vl_checkpoint)
    t = torch.tensor([ids])
    ref, delta = model.model.get_rope_index(t, (t == spec.image_token_id).int(),
                                            image_grid_thw=torch.tensor([i.grid for i in images]))
    assert torch.equal(positions, ref[:, 0])
    assert shift == delta.item() and shift < 0


def test_vision_tower_matches_transformers(odd_vl_checkpoint):
    from transformers import Qwen3_5ForConditionalGeneration

    uris = [image_data_uri(20, 28, 1), image_data_uri(9, 30, 2)]
    pixels, grids = reference_pixels(uris, ODD_PREPROCESSOR)
    config = checkpoint_config(odd_vl_checkpoint)
    tower = VisionTower(config["vision_config"], torch.float32, torch.device("cpu"))
    with CheckpointReader(safetensors_files(odd_vl_checkpoint)) as r:
        tower.load(r)
    model = cached_model(Qwen3_5ForConditionalGeneration, odd_vl_checkpoint)
    with torch.no_grad():
        ref = torch.cat(model.model.get_image_features(pixels, grids).pooler_output)
    mine = tower(pixels, [tuple(g) for g in grids.tolist()])
    torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


# ---- parity through the offline API ----


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)], ids=["tp1", "tp2-chunk16"])
def vl_llm(request, vl_checkpoint):
    """tp=1 prefills in one chunk; tp=2 in 16-token chunks, so images straddle chunk boundaries."""
    mp = pytest.MonkeyPatch()
    if request.param == 2:
        mp.setenv("NEURON_PREFILL_CHUNK_TOKENS", "16")
    engine = LLM(str(vl_checkpoint), tensor_parallel_size=request.param, max_model_len=384, max_num_seqs=4)
    mp.undo()
    yield engine
    engine.shutdown()


def _cases(path):
    uris = [image_data_uri(20, 28, 1), image_data_uri(36, 24, 2), image_data_uri(48, 40, 3)]
    long_text = [(i * 29 + 7) % 1300 for i in range(70)]
    return [
        (image_prompt(path, [10, 20, 30, 40]), []),
        (image_prompt(path, [11, 12], None, [13, 14, 15]), uris[:1]),
        (image_prompt(path, [16], None, [17, 18], None, [19]), uris[:2]),
        # an image in the middle of a long prompt: at 16-token chunks it spans two chunk boundaries
        (image_prompt(path, long_text[:40], None, long_text[40:]), uris[2:]),
    ]


def test_image_parity(vl_llm, vl_checkpoint):
    """All cases in one batch: image prefills run beside text prefill and decodes."""
    cases = _cases(vl_checkpoint)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": uris}} for ids, uris in cases]
    outs = vl_llm.generate(prompts, params)
    for out, (ids, uris) in zip(outs, cases):
        assert_image_parity(out, *image_reference(vl_checkpoint, ids, uris, NEW_TOKENS))
        assert len(out.prompt_token_ids) > len(ids) or not uris  # placeholders were expanded


@pytest.mark.slow
def test_image_parity_at_tp4(vl_checkpoint, monkeypatch):
    """The same cases over four ranks, in 16-token chunks."""
    monkeypatch.setenv("NEURON_PREFILL_CHUNK_TOKENS", "16")
    cases = _cases(vl_checkpoint)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(str(vl_checkpoint), tensor_parallel_size=4, max_model_len=384, max_num_seqs=4) as llm:
        outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": uris}} for ids, uris in cases],
                            params)
    for out, (ids, uris) in zip(outs, cases):
        assert_image_parity(out, *image_reference(vl_checkpoint, ids, uris, NEW_TOKENS))


def test_same_image_alone_equals_in_batch(vl_llm, vl_checkpoint):
    ids, uris = _cases(vl_checkpoint)[2]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    alone = vl_llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": uris}}, params)[0]
    again = vl_llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": uris}}] * 3, params)
    assert all(o.outputs[0].token_ids == alone.outputs[0].token_ids for o in again)


def test_chat_with_pil_image(vl_llm, vl_checkpoint):
    """LLM.chat takes image parts (a PIL image here) through the checkpoint's template."""
    from PIL import Image

    from neuron.engine.tokenizer import Tokenizer

    image = Image.fromarray(np.random.default_rng(9).integers(0, 256, (24, 20, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}]}]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    out = vl_llm.chat(messages, params)[0]
    tok = Tokenizer.from_dir(vl_checkpoint)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                                   add_generation_prompt=True)
    assert_image_parity(out, *image_reference(vl_checkpoint, tok.encode(text), [_png(image)], NEW_TOKENS))


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_parity_on_a_checkpoint_shaped_differently(odd_vl_checkpoint, tp):
    cases = [(image_prompt(odd_vl_checkpoint, [3, 4, 5], None, [6, 7]), [image_data_uri(14, 22, 4)]),
             (image_prompt(odd_vl_checkpoint, [8], None, [9], None, [10, 11]),
              [image_data_uri(12, 12, 5), image_data_uri(30, 10, 6)])]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(str(odd_vl_checkpoint), tensor_parallel_size=tp, max_model_len=256, max_num_seqs=2) as llm:
        outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": u}} for ids, u in cases], params)
    for out, (ids, uris) in zip(outs, cases):
        assert_image_parity(out, *image_reference(odd_vl_checkpoint, ids, uris, NEW_TOKENS))


@pytest.mark.slow
def test_preempted_image_request_is_recomputed_equal(vl_checkpoint):
    """A KV pool too small for three image requests at once: some are preempted and recomputed
    (images included) and still match transformers."""
    text = [(i * 31 + 3) % 1300 for i in range(30)]
    cases = [(image_prompt(vl_checkpoint, text[:20 + k], None, text[20 + k:]), [image_data_uri(20, 28, 20 + k)])
             for k in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    block_bytes = 2 * 2 * 1 * 32 * 16 * 4  # K and V, 2 full-attention layers, 1 KV head, head_dim 32, 16 tokens
    with LLM(str(vl_checkpoint), max_model_len=160, max_num_seqs=3, kv_cache_memory=10 * block_bytes) as llm:
        outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": u}} for ids, u in cases], params)
        assert llm.engine.scheduler.num_preemptions > 0
    for out, (ids, uris) in zip(outs, cases):
        assert out.outputs[0].token_ids == image_reference(vl_checkpoint, ids, uris, new_tokens=80)[0]


# ---- guards: refused before any device work ----


def _bad_images():
    png = image_data_uri(20, 20, 1)
    truncated = "data:image/png;base64," + base64.b64encode(base64.b64decode(png.partition(",")[2])[:60]).decode()
    return [
        ("https://example.com/cat.png", 400, "invalid_image_url"),
        ("/etc/passwd", 400, "invalid_image_url"),
        ("data:image/png,rawbytes", 400, "invalid_image_url"),
        ("data:image/png;base64,@@not base64@@", 400, "invalid_image"),
        ("data:image/png;base64," + base64.b64encode(b"plain text, not an image").decode(), 400, "invalid_image"),
        (truncated, 400, "invalid_image"),
        (image_data_uri(1, 300, 2), 400, "invalid_image"),  # aspect ratio over 200:1
    ]


@pytest.mark.parametrize("uri,status,code", _bad_images())
def test_bad_images_are_refused_with_their_status(vl_llm, vl_checkpoint, uri, status, code):
    before = vl_llm.engine.scheduler.num_preemptions, vl_llm.engine.has_unfinished()
    ids = image_prompt(vl_checkpoint, [1, 2], None, [3])
    good = {"prompt_token_ids": image_prompt(vl_checkpoint, [4], None),
            "multi_modal_data": {"image": image_data_uri(8, 8)}}
    with pytest.raises(ImageError) as info:
        vl_llm.generate([good, {"prompt_token_ids": ids, "multi_modal_data": {"image": [uri]}}],
                     SamplingParams(max_tokens=2))
    assert (info.value.status, info.value.code) == (status, code)
    assert (vl_llm.engine.scheduler.num_preemptions, vl_llm.engine.has_unfinished()) == before  # nothing was queued


def test_images_over_the_pixel_limit_get_413(vl_llm, vl_checkpoint, monkeypatch):
    monkeypatch.setenv("NEURON_VISION_MAX_PIXELS", "1000")
    ids = image_prompt(vl_checkpoint, [1], None)
    with pytest.raises(ImageError) as info:
        vl_llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image_data_uri(40, 40)}})
    assert (info.value.status, info.value.code) == (413, "image_too_large")
    assert "NEURON_VISION_MAX_PIXELS" in str(info.value)
    assert not vl_llm.engine.has_unfinished()


def test_images_too_large_for_one_protocol_line_get_413(vl_llm, vl_checkpoint, monkeypatch):
    monkeypatch.setenv("NEURON_MAX_LINE_BYTES", str((1 << 20) + 100))
    with pytest.raises(ImageError) as info:
        vl_llm.engine.inputs.check_images([image_data_uri(20, 20, 1)] * 2)
    assert (info.value.status, info.value.code) == (413, "image_too_large")
    assert "NEURON_MAX_LINE_BYTES" in str(info.value)


def test_placeholder_count_must_match_the_images(vl_llm, vl_checkpoint):
    two = image_prompt(vl_checkpoint, [1], None, [2], None)
    with pytest.raises(ImageError, match="2 image placeholder"):
        vl_llm.generate({"prompt_token_ids": two, "multi_modal_data": {"image": [image_data_uri(8, 8)]}})
    with pytest.raises(RequestError, match="placeholder"):  # placeholders with no images at all
        vl_llm.generate({"prompt_token_ids": two})


def test_gpu_memory_guard_answers_503(vl_llm, vl_checkpoint, monkeypatch):
    """On CUDA the engine compares the vision tower's activation bound with free GPU memory."""
    engine = vl_llm.engine
    monkeypatch.setattr(engine.inputs, "device", "cuda:0")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1024, 2**30))
    with pytest.raises(ImageError) as info:
        engine.inputs.check_images([image_data_uri(20, 20)])
    assert (info.value.status, info.value.code) == (503, "insufficient_vram")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**34, 2**35))
    assert len(engine.inputs.check_images([image_data_uri(20, 20)])) == 1


def test_the_samples_of_a_request_run_the_vision_tower_once(vl_llm, vl_checkpoint, monkeypatch):
    """n samples are admitted together, each a sequence of its own with the same image; the tower's
    output for it is kept, so it runs once, and each sample equals the request sent alone."""
    tower = vl_llm.engine.executor.rank0.models["model"].model.vision
    calls = []
    run = type(tower).__call__
    monkeypatch.setattr(type(tower), "__call__", lambda self, *a: (calls.append(a[1]), run(self, *a))[1])
    uri = image_data_uri(24, 20, 77)
    prompt = {"prompt_token_ids": image_prompt(vl_checkpoint, [3, 4], None, [5]),
              "multi_modal_data": {"image": uri}}
    greedy = SamplingParams(temperature=0.0, max_tokens=4, n=3)
    out = vl_llm.generate(prompt, greedy)[0]
    assert len(calls) == 1
    assert [o.token_ids for o in out.outputs] == [out.outputs[0].token_ids] * 3
    vl_llm.generate(prompt, greedy)  # and the next request with it finds it too
    assert len(calls) == 1


def test_cpu_memory_guard_answers_503_for_every_rank_on_the_host(vl_llm, monkeypatch):
    """On CPU the bound, times the ranks that each run the tower in the same memory, is compared
    with the memory the kernel says is available."""
    from neuron.engine import input_processor

    engine = vl_llm.engine
    ranks = len(engine.executor.devices)
    assert engine.inputs.device == "cpu" and engine.inputs.ranks_on_device == ranks
    need = ranks * vision_activation_bytes(engine.model.vision, engine.inputs.check_images([image_data_uri(20, 20)]), 4)
    monkeypatch.setattr(input_processor, "available_memory", lambda: need - 1)
    with pytest.raises(ImageError) as info:
        engine.inputs.check_images([image_data_uri(20, 20)])
    assert (info.value.status, info.value.code) == (503, "insufficient_memory")
    monkeypatch.setattr(input_processor, "available_memory", lambda: need)
    assert len(engine.inputs.check_images([image_data_uri(20, 20)])) == 1


def test_text_models_refuse_images(tmp_path):
    from checkpoints import BASE, build_checkpoint

    path = build_checkpoint(tmp_path / "qwen3", **BASE)
    with LLM(str(path), max_model_len=64) as llm:
        with pytest.raises(ImageError) as info:
            llm.generate({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": image_data_uri(8, 8)}})
        assert (info.value.status, info.value.code) == (400, "vision_unsupported")


# ---- the rank refuses a step whose images do not fit alike on every rank, changing nothing ----


@pytest.fixture(scope="module")
def rank(vl_checkpoint):
    r = Worker(0, 1)
    r.execute(p.LoadShard(seq=1, model_id="m", shard=shard_spec(vl_checkpoint, max_num_seqs=2, max_model_len=128,
                                                                 max_num_batched_tokens=128)))
    yield r
    r.close()


def _step(*seqs: p.SeqStep, model_id: str = "m") -> p.ForwardStep:
    return p.ForwardStep(seq=2, model_id=model_id, seqs=list(seqs))


def _first(ids: list[int], images: list[StepImage], slot: int = 0) -> p.SeqStep:
    """A sequence's first step in `slot`, with blocks for its tokens and one more."""
    return p.SeqStep(slot, ids, 0, list(range(slot * 8, slot * 8 + len(ids) // 16 + 1)), True, images=images)


def test_rank_refuses_mismatched_images_before_any_work(rank, vl_checkpoint):
    spec = vision_spec(vl_checkpoint)
    uri = image_data_uri(20, 28, 1)
    ids = expand_placeholders(image_prompt(vl_checkpoint, [1, 2], None, [3]), spec.image_token_id,
                              [check_image(uri, spec)])
    start, count = ids.index(spec.image_token_id), ids.count(spec.image_token_id)
    good = StepImage(uri, start)
    cases = [
        (_first(ids, [StepImage(uri, start + 1)]), "do not hold the image placeholders"),  # text where one should be
        (_first(ids, [StepImage(uri, start - 1)]), "do not hold the image placeholders"),
        (_first(ids, [good, StepImage(uri, start + 1)]), "image 1 starts at"),  # inside image 0's tokens
        (_first(ids, [StepImage(uri, 129 - count)]), "pass the model's length 128"),
        (_first(ids, [StepImage("data:image/png;base64,AAAA", start)]), "image 0"),
    ]
    for seq, match in cases:
        reply, _ = rank.execute(_step(seq))
        assert isinstance(reply, p.Error) and reply.kind == p.ErrorKind.BAD_REQUEST, reply
        assert match in reply.message
    ok, _ = rank.execute(_step(_first(ids, [good])))
    assert isinstance(ok, p.ForwardStepOk)
    later, _ = rank.execute(_step(p.SeqStep(0, [5], len(ids), images=[good])))  # images ride the first step only
    assert later.kind == p.ErrorKind.BAD_REQUEST and "first step only" in later.message
    missing, _ = rank.execute(_step(model_id="nope"))
    assert missing.kind == p.ErrorKind.MODEL_NOT_LOADED


def test_rank_checks_each_chunk_against_its_images(rank, vl_checkpoint):
    """A later chunk of a prompt with images must hold placeholders where the first step's spans
    said; a refused chunk leaves the sequence where it was, and the right one then runs."""
    spec = vision_spec(vl_checkpoint)
    uri = image_data_uri(20, 28, 1)
    ids = expand_placeholders(image_prompt(vl_checkpoint, [1, 2], None, [3]), spec.image_token_id,
                              [check_image(uri, spec)])
    start = ids.index(spec.image_token_id)
    assert isinstance(rank.execute(_step(_first(ids[: start + 2], [StepImage(uri, start)], slot=1)))[0],
                      p.ForwardStepOk)
    rest = ids[start + 2 :]
    wrong, _ = rank.execute(_step(p.SeqStep(1, [7] + rest[1:], start + 2, list(range(9, 12)))))
    assert wrong.kind == p.ErrorKind.BAD_REQUEST and "do not hold the image placeholders" in wrong.message
    right, _ = rank.execute(_step(p.SeqStep(1, rest, start + 2, list(range(9, 12)))))
    assert isinstance(right, p.ForwardStepOk)


def test_a_rank_without_a_vision_tower_refuses_images(rank, tmp_path):
    from checkpoints import BASE, build_checkpoint

    path = build_checkpoint(tmp_path / "qwen3", **BASE)
    rank.execute(p.LoadShard(seq=1, model_id="text", shard=shard_spec(path, max_num_seqs=2, max_model_len=64,
                                                                       max_num_batched_tokens=64)))
    try:
        reply, _ = rank.execute(_step(_first([1, 2, 3], [StepImage(image_data_uri(8, 8), 1)]), model_id="text"))
        assert reply.kind == p.ErrorKind.UNSUPPORTED_ARCH and "vision tower" in reply.message
    finally:
        rank.execute(p.UnloadModel(seq=3, model_id="text"))


# ---- one step op: an image prompt's prefill in chunks, beside other requests' decodes ----


def test_a_text_stream_gets_tokens_between_the_chunks_of_a_long_image_prefill(vl_checkpoint, monkeypatch):
    """A long prompt with an image is chunked like any prompt: in every step of its prefill the
    decoding text request beside it gets a token, and its output still matches transformers."""
    monkeypatch.setenv("NEURON_PREFILL_CHUNK_TOKENS", "16")
    text = [(i * 13 + 5) % 1300 for i in range(90)]
    ids, uris = image_prompt(vl_checkpoint, text[:40], None, text[40:]), [image_data_uri(48, 40, 3)]
    with LLM(str(vl_checkpoint), max_model_len=384, max_num_seqs=2) as llm:
        engine = llm.engine
        images = engine.inputs.check_images(uris)
        expanded = engine.inputs.expand_images(ids, images)
        got: dict[str, list[int]] = {"text": [], "image": []}

        def step() -> None:
            for update in engine.step():
                got[update.request_id] += update.token_ids

        engine.add_request("text", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
        step()  # the text prompt: its first token
        engine.add_request("image", expanded, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           images)
        during = []
        while not got["image"]:
            before = len(got["text"])
            step()
            during.append(len(got["text"]) - before)
        while engine.has_unfinished():
            step()
    # a 16-token step: the text request's token and 15 of the prompt's
    assert len(during) == math.ceil(len(expanded) / 15) >= 6
    assert during == [1] * len(during)
    assert got["image"] == image_reference(vl_checkpoint, ids, uris, NEW_TOKENS)[0]


@pytest.mark.slow
def test_worker_killed_before_an_image_prefill_fails_cleanly_and_recovers(vl_checkpoint):
    """The image step fails with an error naming the dead rank, the engine rebuilds its ranks, and
    the same request then matches transformers."""
    import os
    import signal

    from neuron.engine.llm_engine import EngineConfig, LLMEngine

    ids, uris = _cases(vl_checkpoint)[1]
    spec = vision_spec(vl_checkpoint)
    images = [check_image(u, spec) for u in uris]
    expanded = expand_placeholders(ids, spec.image_token_id, images)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=str(vl_checkpoint), tp=2, device="cpu", dtype="float32", max_num_seqs=2,
                                    max_model_len=128)).start()

    def run(rid: str) -> tuple[list[int], str | None]:
        engine.add_request(rid, expanded, params, images)
        tokens = []
        for _ in range(100):
            for u in engine.step():
                tokens += u.token_ids
                if u.finished:
                    return tokens, u.error
        raise AssertionError("the request did not finish")

    try:
        os.kill(engine.executor.pool.workers[-1].proc.pid, signal.SIGKILL)
        tokens, error = run("doomed")
        assert error is not None and "rank 1" in error
        engine.recover()
        tokens, error = run("again")
        assert error is None
        assert tokens == image_reference(vl_checkpoint, ids, uris, NEW_TOKENS)[0]
    finally:
        engine.shutdown()
