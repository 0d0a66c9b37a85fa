"""The embedded default checkpoint: a tiny random Qwen3 with a real byte-level BPE tokenizer.

`neuron serve` with no model serves this, so a fresh machine works without a download. It is
built once into the user cache, deterministically (the same bytes on every machine with the same
library versions), and atomically: a temporary folder renamed into place, so two processes that
race both end up reading one complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from neuron.utils.cache_dir import cache_root

NAME = "default-qwen3-tiny-v1"
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

SEED = 20250501
BPE_VOCAB = 2000  # upper bound on the trained vocabulary, including the 256 byte symbols
MAX_POSITIONS = 4096
ROPE_THETA = 1000000.0
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16

# Added tokens in Qwen3's order. Special ones are dropped by decode(skip_special_tokens=True);
# the others are ordinary text that reasoning and tool-call parsers look for.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEXT_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")

# Qwen2/Qwen3's pre-tokenizer split: contractions, letter runs, single digits, punctuation, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = """\
The morning train left the station a few minutes after six. Most of the passengers were still
half asleep, holding paper cups of coffee and watching the grey fields roll past the windows.
A child in the front carriage counted the cows out loud: one, two, three, four, five, and then
gave up when a whole herd appeared near the river. Her father smiled and opened his newspaper.

Language models read text as a sequence of tokens. A tokenizer splits a sentence into pieces
that are common enough to deserve their own number, and falls back to single bytes for anything
rare, such as an unusual name, a symbol, or a word in another script. Because every byte has a
token, there is no text that cannot be written down, although rare text takes more tokens.

To make bread, mix four cups of flour with a spoon of salt, a little yeast and warm water. Knead
the dough for ten minutes until it is smooth, then leave it in a covered bowl for an hour while
it rises. Shape the loaf, let it rest again, and bake it in a hot oven for about forty minutes.
The crust should be brown and the bottom should sound hollow when you knock on it.

Questions and answers:
What is the capital of France? The capital of France is Paris.
How many days are there in a week? There are seven days in a week.
Which planet is closest to the sun? Mercury is the planet closest to the sun.
What do plants need to grow? Plants need light, water, air and nutrients from the soil.
Can you help me write an email to my team? Of course. Tell me what the email should say.

The server accepts requests over HTTP and streams the answer back as it is generated. Each
request carries a list of messages: a system message that sets the tone, the user's question,
and sometimes earlier replies from the assistant. The assistant may think before it answers, and
it may call a tool, such as a calculator or a search engine, and read the result before it
continues. When the answer is complete, the model writes an end token and the stream stops.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

{"name": "get_weather", "arguments": {"city": "London", "unit": "celsius"}}
{"temperature": 18, "condition": "cloudy", "wind": "light"}

In the autumn the forest changes colour. The leaves of the maple turn red and orange, the birch
turns yellow, and the oak holds on to its brown leaves long into the winter. People walk along
the paths with their dogs, collecting chestnuts and mushrooms, and the air smells of rain and
smoke from the houses in the valley. By November the days are short and the evenings are cold.

A good explanation starts from what the reader already knows. It introduces one new idea at a
time, gives an example for each, and says why the idea matters. It avoids long words when short
ones will do, and it stops when the point has been made. Writing clearly is mostly a matter of
thinking clearly, and of being willing to cut the sentences that do not help.

The numbers 0, 1, 2, 3, 4, 5, 6, 7, 8 and 9 are the digits. Twelve plus thirty is forty-two.
The year has 365 days, or 366 in a leap year. A kilometre is 1000 metres and an hour is 3600
seconds. If a car travels at 90 kilometres per hour, it covers 1.5 kilometres every minute.

She opened the door and said, "Good evening! I'm glad you could come. We've been waiting for
you, and dinner is almost ready." He took off his coat, which was wet from the rain, and they
sat down at the long wooden table. They talked about their work, their friends, the books they
had read and the places they wanted to visit next summer, until it was very late.

Thank you for your message. I have read your question carefully and I think the answer is yes,
but there are a few details to check first. Could you tell me which version you are using, and
what you expected to happen? With that information I can give you a more useful reply.

The library opens at nine in the morning and closes at eight in the evening, except on Sundays.
Students come to study in the quiet rooms upstairs, older readers sit by the windows with the
daily papers, and small children listen to stories in the corner with the soft chairs. The
librarians know where every book belongs, and they are happy to help anyone find what they need.

To install the program, download the package, unpack it into a folder of your choice and run
the setup script. If the script reports an error, read the message carefully: it usually names
the missing file or the setting that has to change. Restart the service after every change to
the configuration, and check the log file to confirm that it started without warnings.

Rivers carry water from the mountains to the sea. On the way they cut valleys, feed lakes and
wetlands, and give drinking water to cities and farms. Fish swim upstream in spring to lay
their eggs, and birds follow the river south in autumn. A healthy river needs clean water,
enough space to flood, and banks covered with trees and plants that hold the soil in place.
"""

# Qwen3-style ChatML: tools in the system turn, <tool_call> blocks for assistant calls, tool
# results folded into a user turn as <tool_response> blocks, and reasoning kept only for the
# assistant turns after the latest real user query. Content may be a string or a list of text parts.
CHAT_TEMPLATE = """\
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content if part is mapping and part.type == "text" -%}
            {{- part.text -}}
            {%- if not loop.last %}{{ "\\n" }}{% endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages | length > 0 and messages[0].role == "system" -%}
{%- if tools -%}
    {{- "<|im_start|>system\\n" -}}
    {%- if has_system -%}
        {{- text_of(messages[0].content) + "\\n\\n" -}}
    {%- endif -%}
    {{- "# Tools\\n\\nYou may call the functions below to help with the user's request.\\n\\n" -}}
    {{- "Their signatures are listed inside <tools></tools> XML tags:\\n<tools>" -}}
    {%- for tool in tools -%}
        {{- "\\n" + (tool | tojson) -}}
    {%- endfor -%}
    {{- "\\n</tools>\\n\\nTo call a function, write a JSON object with its name and arguments " -}}
    {{- "inside <tool_call></tool_call> XML tags:\\n<tool_call>\\n" -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif has_system -%}
    {{- "<|im_start|>system\\n" + text_of(messages[0].content) + "<|im_end|>\\n" -}}
{%- endif -%}
{%- set state = namespace(last_query=messages | length - 1) -%}
{%- for message in messages -%}
    {%- if message.role == "user" -%}
        {%- set text = text_of(message.content) -%}
        {%- if not (text.startswith("<tool_response>") and text.endswith("</tool_response>")) -%}
            {%- set state.last_query = loop.index0 -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set content = text_of(message.content) -%}
    {%- if message.role == "system" -%}
        {%- if not loop.first -%}
            {{- "<|im_start|>system\\n" + content + "<|im_end|>\\n" -}}
        {%- endif -%}
    {%- elif message.role == "user" -%}
        {{- "<|im_start|>user\\n" + content + "<|im_end|>\\n" -}}
    {%- elif message.role == "assistant" -%}
        {%- set reasoning = "" -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif "</think>" in content -%}
            {%- set reasoning = content.split("</think>")[0].rstrip("\\n").split("<think>")[-1].lstrip("\\n") -%}
            {%- set content = content.split("</think>")[-1].lstrip("\\n") -%}
        {%- endif -%}
        {{- "<|im_start|>assistant\\n" -}}
        {%- if loop.index0 > state.last_query and (loop.last or reasoning) -%}
            {{- "<think>\\n" + reasoning.strip("\\n") + "\\n</think>\\n\\n" -}}
            {%- set content = content.lstrip("\\n") -%}
        {%- endif -%}
        {{- content -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}
                {{- "\\n" -}}
            {%- endif -%}
            {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- fn.arguments | tojson -}}
            {%- endif -%}
            {{- "}\\n</tool_call>" -}}
        {%- endfor -%}
        {{- "<|im_end|>\\n" -}}
    {%- elif message.role == "tool" -%}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" -%}
            {{- "<|im_start|>user" -}}
        {%- endif -%}
        {{- "\\n<tool_response>\\n" + content + "\\n</tool_response>" -}}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" -%}
            {{- "<|im_end|>\\n" -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception("unsupported message role " ~ message.role ~ "; use system, user, assistant or tool") -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- "<|im_start|>assistant\\n" -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- "<think>\\n\\n</think>\\n\\n" -}}
    {%- endif -%}
{%- endif -%}
"""


def default_model_dir() -> Path:
    """The default checkpoint's folder, built on first use."""
    root = cache_root()
    final = root / NAME
    if _complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}.", dir=root))
    try:
        build_checkpoint(tmp)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _complete(path: Path) -> bool:
    return all((path / name).is_file() for name in FILES)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished build into place; a rival's complete build wins, a broken one is replaced."""
    for _ in range(2):
        try:
            os.rename(tmp, final)
            return
        except OSError:
            if _complete(final):
                return
            # A partial folder left by something else: move it aside, then try once more.
            trash = Path(tempfile.mkdtemp(prefix=f".{NAME}.broken.", dir=final.parent))
            try:
                os.rename(final, trash / NAME)
            except OSError:
                pass
            shutil.rmtree(trash, ignore_errors=True)
    if not _complete(final):
        raise OSError(f"could not install the default checkpoint into {final}")


def build_checkpoint(out: Path) -> None:
    """Write every file of the default checkpoint into the existing folder `out`."""
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + TEXT_TOKENS}
    vocab_size = -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64
    _write_json(out / "tokenizer_config.json", tokenizer_config(ids))
    _write_json(out / "config.json", model_config(vocab_size, ids))
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids["<|endoftext|>"],
            "do_sample": True,
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
            "temperature": 0.6,
            "top_k": 20,
            "top_p": 0.95,
        },
    )
    save_file(random_weights(vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})


def build_tokenizer(special: tuple[str, ...] = SPECIAL_TOKENS, text: tuple[str, ...] = TEXT_TOKENS) -> Tokenizer:
    """A byte-level BPE tokenizer trained on CORPUS, set up the way Qwen's is, with the added
    tokens `special` (dropped when decoding skips special tokens) and `text` after its vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in text])
    return tok


def tokenizer_config(ids: dict[str, int]) -> dict:
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t, i in sorted(ids.items(), key=lambda kv: kv[1])
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MAX_POSITIONS,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def model_config(vocab_size: int, ids: dict[str, int]) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": LAYERS,
        "model_type": "qwen3",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def weight_shapes(vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face Qwen3 tensor names and shapes; no lm_head because the embeddings are tied."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": (HEAD_DIM,),
            p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        }
    shapes["model.norm.weight"] = (HIDDEN,)
    return shapes


def random_weights(vocab_size: int) -> dict[str, torch.Tensor]:
    """Seeded weights: N(0, 0.02) matrices and all-ones norm scales, drawn in a fixed order."""
    gen = torch.Generator().manual_seed(SEED)
    weights = {}
    for name, shape in weight_shapes(vocab_size).items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape, dtype=torch.float32)
        else:
            weights[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02
    return weights


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
