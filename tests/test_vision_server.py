"""Image chat completions through `neuron serve --tp 2` on a tiny Qwen3.5 vision checkpoint: greedy
tokens equal transformers' on the same prompt and pixels, and bad images are refused before any
model work. One server process for the module, with NEURON_VISION_MAX_PIXELS set low (MAX_PIXELS)."""

from __future__ import annotations

import base64

import openai
import pytest
from server_harness import ServeProcess, client, metric
from vision_checkpoint import build_vision_checkpoint, image_data_uri, reference_greedy_mm, reference_pixels

NEW_TOKENS = 8
MAX_PIXELS = 2000  # the test images are below it, except the one that tests the limit
MAX_MODEL_LEN = 128
MERGE = 2  # the checkpoint's spatial merge: one placeholder token per MERGE x MERGE patches

pytestmark = pytest.mark.slow  # a `neuron serve --tp 2` subprocess


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return build_vision_checkpoint(tmp_path_factory.mktemp("qwen3_5_vision"), seed=7)


@pytest.fixture(scope="module")
def vision_process(vl_checkpoint):
    """`neuron serve --tp 2` on the vision checkpoint, as a subprocess."""
    args = (str(vl_checkpoint), "--tp", "2", "--device", "cpu", "--dtype", "float32", "--served-model-name", "vision",
            "--max-model-len", str(MAX_MODEL_LEN))
    with ServeProcess(*args, env={"NEURON_VISION_MAX_PIXELS": str(MAX_PIXELS)}) as s:
        yield s


def chat(server, messages: list[dict], max_tokens: int = NEW_TOKENS):
    return client(server).chat.completions.create(
        model="vision", messages=messages, max_tokens=max_tokens, temperature=0, logprobs=True, top_logprobs=5,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})


def image(uri: str) -> dict:
    return {"type": "image_url", "image_url": {"url": uri}}


def oracle(checkpoint, messages: list[dict], uris: list[str]) -> tuple[list[int], list[int], list]:
    """transformers end to end: its tokenizer renders the chat, its image processor makes the
    pixels, and each image's one placeholder becomes grid / MERGE**2 of them. Returns the
    expanded prompt, the greedy tokens and their log-softmax rows."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pixels, grids = reference_pixels(uris)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    counts = iter(int(g.prod()) // MERGE**2 for g in grids)
    prompt = []
    for t in tok.encode(text, add_special_tokens=False):
        prompt += [t] * next(counts) if t == pad else [t]
    assert next(counts, None) is None, "every image has its placeholder"
    tokens, logprobs = reference_greedy_mm(checkpoint, prompt, pixels, grids, NEW_TOKENS)
    return prompt, tokens, logprobs


def check_against_oracle(server, checkpoint, messages: list[dict], uris: list[str]) -> None:
    out = chat(server, messages)
    prompt, ref_tokens, ref_logprobs = oracle(checkpoint, messages, uris)
    entries = out.choices[0].logprobs.content
    assert [int(e.token.removeprefix("token_id:")) for e in entries] == ref_tokens
    for step, entry in enumerate(entries):
        assert abs(entry.logprob - ref_logprobs[step][ref_tokens[step]].item()) <= 1e-3
    assert out.usage.prompt_tokens == len(prompt)  # the placeholders as expanded, not as rendered
    assert out.choices[0].finish_reason == "length"


def test_one_image(vision_process, vl_checkpoint):
    uri = image_data_uri(20, 28, seed=1)
    check_against_oracle(vision_process, vl_checkpoint, [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"}, image(uri)]}], [uri])


def test_two_images_in_a_later_turn(vision_process, vl_checkpoint):
    first, second, third = image_data_uri(24, 16, seed=2), image_data_uri(20, 28, seed=3), image_data_uri(12, 36, 4)
    messages = [
        {"role": "user", "content": [image(first), {"type": "text", "text": "Describe it."}]},
        {"role": "assistant", "content": "It is noise."},
        {"role": "user", "content": [{"type": "text", "text": "And these two?"}, image(second), image(third)]},
    ]
    check_against_oracle(vision_process, vl_checkpoint, messages, [first, second, third])


def png_bytes_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


GUARDS = [
    ("http://example.com/cat.png", 400, "invalid_image_url"),
    ("file:///etc/passwd", 400, "invalid_image_url"),
    ("/etc/passwd", 400, "invalid_image_url"),
    ("data:image/png;base64,!!not base64!!", 400, "invalid_image"),
    (png_bytes_uri(b"these bytes are not an image"), 400, "invalid_image"),
    (png_bytes_uri(base64.b64decode(image_data_uri(20, 20).partition(",")[2])[:60]), 400, "invalid_image"),  # cut
    (image_data_uri(50, 50), 413, "image_too_large"),  # 2500 pixels
]


def test_bad_images_are_refused_before_any_model_work(vision_process):
    admitted = metric(vision_process, "neuron_prompt_tokens_total")
    for uri, status, code in GUARDS:
        with pytest.raises(openai.APIStatusError) as e:
            chat(vision_process, [{"role": "user", "content": [{"type": "text", "text": "look"}, image(uri)]}])
        assert (e.value.status_code, e.value.code) == (status, code), uri[:40]
        assert e.value.param == "messages"
    # 4 images of 44x44 expand to 4 x 36 placeholders: over the context, though the rendered prompt is short.
    with pytest.raises(openai.BadRequestError) as e:
        chat(vision_process, [{"role": "user", "content": [image(image_data_uri(44, 44, seed=s)) for s in range(4)]}])
    assert e.value.code == "context_length_exceeded"
    assert metric(vision_process, "neuron_prompt_tokens_total") == admitted
    assert metric(vision_process, 'neuron_requests_total{endpoint="chat",status="413"}') == 1
    out = chat(vision_process, [{"role": "user", "content": [image(image_data_uri(16, 16))]}], max_tokens=1)
    assert out.usage.completion_tokens == 1
    assert metric(vision_process, "neuron_prompt_tokens_total") == admitted + out.usage.prompt_tokens


def test_image_parts_need_a_url(vision_process):
    with pytest.raises(openai.BadRequestError) as e:
        chat(vision_process, [{"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "low"}}]}])
    assert e.value.param == "messages[0].content[0].image_url"
