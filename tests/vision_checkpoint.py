"""A tiny random Qwen3.5 vision checkpoint with a real tokenizer and chat template, built by the
tests with transformers, and transformers' own greedy decode on it (the oracle)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import torch
from checkpoints import cached_model, greedy_with_logprobs
from test_qwen3_5 import MULTIMODAL_TEXT, VISION
from tokenizers import AddedToken

from neuron.multimodal.image import VisionSpec, check_image, expand_placeholders
from neuron.utils.default_checkpoint import build_tokenizer, tokenizer_config

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

# Small pixel bounds, so test images take a few dozen placeholder tokens at most.
PREPROCESSOR = {
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 256, "longest_edge": 4096},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessor",
}

# ChatML; a content list renders its text parts as text and its image parts as Qwen's placeholder.
CHAT_TEMPLATE = """\
{%- for message in messages -%}
    {{- "<|im_start|>" + message.role + "\\n" -}}
    {%- if message.content is string -%}
        {{- message.content -}}
    {%- elif message.content is iterable -%}
        {%- for part in message.content -%}
            {%- if part.type == "text" -%}
                {{- part.text -}}
            {%- elif part.type in ("image", "image_url") -%}
                {{- "<|vision_start|><|image_pad|><|vision_end|>" -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- "<|im_end|>\\n" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- "<|im_start|>assistant\\n" -}}
{%- endif -%}
"""


def _classes(model_type: str) -> tuple[type, type]:
    """transformers' config and model classes for a multimodal `model_type`."""
    import transformers

    prefix = {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}[model_type]
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForConditionalGeneration")


def build_vision_checkpoint(path: Path, seed: int = 0, text: dict | None = None, vision: dict | None = None,
                            preprocessor: dict | None = None, model_type: str = "qwen3_5") -> Path:
    """Write a random fp32 multimodal model (Qwen3_5ForConditionalGeneration, or the class of
    `model_type`), its tokenizer and preprocessor into `path`; `text`, `vision` and
    `preprocessor` replace the default shapes."""
    config_cls, model_cls = _classes(model_type)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    tok.save(str(path / "tokenizer.json"))
    ids = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
    tok_config = tokenizer_config(ids) | {"chat_template": CHAT_TEMPLATE}
    for entry in tok_config["added_tokens_decoder"].values():
        entry["special"] |= entry["content"] in VISION_TOKENS
    _write_json(path / "tokenizer_config.json", tok_config)
    _write_json(path / "preprocessor_config.json", preprocessor or PREPROCESSOR)

    vocab_size = -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64
    text = dict(text or MULTIMODAL_TEXT, vocab_size=vocab_size, initializer_range=0.25)
    config = config_cls(
        text_config=text, vision_config=dict(vision or VISION, initializer_range=0.25), tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model_cls(config).eval().save_pretrained(path, safe_serialization=True)
    return path


def image_data_uri(width: int, height: int, seed: int = 0) -> str:
    """A PNG of deterministic random pixels, as a base64 data: URI."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def reference_pixels(uris: list[str], preprocessor: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values and image_grid_thw from transformers' own image processor, set up as
    preprocessor_config.json says (independent of neuron's preprocessing)."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    kw = {k: v for k, v in (preprocessor or PREPROCESSOR).items() if k != "image_processor_type"}
    processor = Qwen2VLImageProcessorPil(**kw)
    images = [Image.open(io.BytesIO(base64.b64decode(u.partition(",")[2]))) for u in uris]  # it converts to RGB itself
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def reference_greedy_mm(path: Path, input_ids: list[int], pixel_values: torch.Tensor | None,
                        image_grid_thw: torch.Tensor | None, max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens on an expanded multimodal prompt (no images when pixel_values
    is None), and the log-softmax of its logits at each step."""
    model = cached_model(_classes(json.loads((path / "config.json").read_text())["model_type"])[1], path)
    ids = torch.tensor([input_ids])
    images = {} if pixel_values is None else {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
    return greedy_with_logprobs(model, input_ids, max_new_tokens,
                                mm_token_type_ids=(ids == model.config.image_token_id).int(), **images)


def checkpoint_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def vision_spec(path: Path) -> VisionSpec:
    """How the checkpoint takes images, as its resolved configuration says."""
    from checkpoints import model_config

    return model_config(path).vision


def image_prompt(path: Path, *pieces) -> list[int]:
    """Token ids from text ids and `None` for an image (vision start, one placeholder, vision end)."""
    c = checkpoint_config(path)
    image = [c["vision_start_token_id"], c["image_token_id"], c["vision_end_token_id"]]
    out = []
    for piece in pieces:
        out += image if piece is None else list(piece)
    return out


def image_reference(path: Path, ids: list[int], uris: list[str], new_tokens: int):
    """transformers' greedy tokens and per-step logprobs for a prompt with one placeholder per image."""
    spec = vision_spec(path)
    images = [check_image(u, spec) for u in uris]
    expanded = expand_placeholders(ids, spec.image_token_id, images)
    pixels = grids = None
    if uris:
        pixels, grids = reference_pixels(uris, json.loads((path / "preprocessor_config.json").read_text()))
    return reference_greedy_mm(path, expanded, pixels, grids, new_tokens)


def assert_image_parity(out, ref_tokens, ref_logprobs, tol: float = 1e-3) -> None:
    c = out.outputs[0]
    assert c.token_ids == ref_tokens
    for step, (lp, ref) in enumerate(zip(c.logprobs, ref_logprobs)):
        token = c.token_ids[step]
        assert abs(lp[token] - ref[token].item()) <= tol, (step, lp[token], ref[token].item())


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
