"""Tiny checkpoints with each dense family's chat set-up, written here: a byte-level BPE trained on
the default model's corpus with the family's added tokens, its BOS post-processor, a chat template
in the family's layout (tools, tool calls and tool results where the family puts them; Llama 2's
has no place for them, so it is a model with no tool-call format) and, for Llama 3, the three stop
ids in generation_config.json. Weights are random (transformers' own model class), so the
checkpoints test formats, not answers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from checkpoints import BASE
from tokenizers import processors

from neuron.engine.tokenizer import Tokenizer
from neuron.utils.default_checkpoint import build_tokenizer

LLAMA3_TEMPLATE = """\
{{- bos_token -}}
{%- set system = messages[0].content if messages and messages[0].role == "system" else "" -%}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" + system + "<|eot_id|>" -}}
{%- for message in messages if message.role != "system" -%}
    {%- if message.role == "user" and loop.first and tools -%}
        {{- "<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, reply with a JSON " -}}
        {{- 'function call: {"name": function name, "parameters": dictionary of argument name and value}.\\n\\n' -}}
        {%- for tool in tools -%}{{- (tool | tojson) + "\\n\\n" -}}{%- endfor -%}
        {{- message.content + "<|eot_id|>" -}}
    {%- elif message.role == "assistant" and message.tool_calls -%}
        {{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n<|python_tag|>" -}}
        {%- for call in message.tool_calls -%}
            {%- set args = call.function.arguments -%}
            {{- '{"name": "' + call.function.name + '", "parameters": ' -}}
            {{- (args if args is string else args | tojson) + "}" -}}
            {%- if not loop.last %}{{ "; " }}{% endif -%}
        {%- endfor -%}
        {{- "<|eom_id|>" -}}
    {%- elif message.role == "tool" -%}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" -}}
    {%- else -%}
        {{- "<|start_header_id|>" + message.role + "<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" -}}{%- endif -%}
"""

QWEN25_TEMPLATE = """\
{%- if tools -%}
    {{- "<|im_start|>system\\n" -}}
    {{- (messages[0].content if messages[0].role == "system" else "You are a helpful assistant.") + "\\n\\n" -}}
    {{- "# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>" -}}
    {%- for tool in tools -%}{{- "\\n" + (tool | tojson) -}}{%- endfor -%}
    {{- '\\n</tools>\\n\\nFor each call, write <tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call>' -}}
    {{- "<|im_end|>\\n" -}}
{%- elif messages[0].role == "system" -%}
    {{- "<|im_start|>system\\n" + messages[0].content + "<|im_end|>\\n" -}}
{%- else -%}
    {{- "<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n" -}}
{%- endif -%}
{%- for message in messages if message.role != "system" -%}
    {%- if message.role == "assistant" and message.tool_calls -%}
        {{- "<|im_start|>assistant" + ("\\n" + message.content if message.content else "") -}}
        {%- for call in message.tool_calls -%}
            {%- set args = call.function.arguments -%}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' -}}
            {{- (args if args is string else args | tojson) + "}\\n</tool_call>" -}}
        {%- endfor -%}
        {{- "<|im_end|>\\n" -}}
    {%- elif message.role == "tool" -%}
        {{- "<|im_start|>user\\n<tool_response>\\n" + message.content + "\\n</tool_response><|im_end|>\\n" -}}
    {%- else -%}
        {{- "<|im_start|>" + message.role + "\\n" + message.content + "<|im_end|>\\n" -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|im_start|>assistant\\n" -}}{%- endif -%}
"""

MISTRAL_TEMPLATE = """\
{{- bos_token -}}
{%- for message in messages -%}
    {%- if message.role == "user" -%}
        {%- if tools and loop.last -%}{{- "[AVAILABLE_TOOLS]" + (tools | tojson) + "[/AVAILABLE_TOOLS]" -}}{%- endif -%}
        {{- "[INST]" + message.content + "[/INST]" -}}
    {%- elif message.role == "assistant" and message.tool_calls -%}
        {{- "[TOOL_CALLS][" -}}
        {%- for call in message.tool_calls -%}
            {%- set args = call.function.arguments -%}
            {{- '{"name": "' + call.function.name + '", "arguments": ' + (args if args is string else args | tojson) -}}
            {{- "}" + (", " if not loop.last else "") -}}
        {%- endfor -%}
        {{- "]" + eos_token -}}
    {%- elif message.role == "assistant" -%}
        {{- message.content + eos_token -}}
    {%- elif message.role == "tool" -%}
        {{- "[TOOL_RESULTS]" + message.content + "[/TOOL_RESULTS]" -}}
    {%- endif -%}
{%- endfor -%}
"""

# Llama 2's chat layout, which has no way to write tool calls: tools and tool turns are left out.
LLAMA2_TEMPLATE = """\
{{- bos_token -}}
{%- for message in messages -%}
    {%- if message.role == "system" -%}
        {{- "<<SYS>>\\n" + message.content + "\\n<</SYS>>\\n\\n" -}}
    {%- elif message.role == "user" -%}
        {{- "[INST] " + message.content + " [/INST]" -}}
    {%- elif message.role == "assistant" -%}
        {{- " " + message.content + eos_token -}}
    {%- endif -%}
{%- endfor -%}
"""

LLAMA3_STOPS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")

# family: (model_type, transformers classes, special tokens, text tokens, bos, eos, template)
FAMILIES = {
    "llama3": ("llama", ("LlamaConfig", "LlamaForCausalLM"),
               ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                "<|eot_id|>", "<|python_tag|>"), (), "<|begin_of_text|>", "<|eot_id|>", LLAMA3_TEMPLATE),
    "qwen2.5": ("qwen2", ("Qwen2Config", "Qwen2ForCausalLM"), ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                ("<tool_call>", "</tool_call>"), None, "<|im_end|>", QWEN25_TEMPLATE),
    "mistral": ("mistral", ("MistralConfig", "MistralForCausalLM"),
                ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                 "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), (), "<s>", "</s>", MISTRAL_TEMPLATE),
    "llama2": ("llama", ("LlamaConfig", "LlamaForCausalLM"), ("<s>", "</s>"), (), "<s>", "</s>", LLAMA2_TEMPLATE),
}


def build_family_checkpoint(path: Path, family: str, seed: int = 0) -> Path:
    """A checkpoint of `family` (a key of FAMILIES) in `path`: weights, tokenizer and template."""
    import transformers

    model_type, (config_name, model_name), special, text, bos, eos, template = FAMILIES[family]
    tok = build_tokenizer(special, text)
    if bos is not None:  # Llama and Mistral prepend BOS to an encoded text, as their tokenizers do
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": t in special} for t in (*special, *text)}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added, "bos_token": bos, "eos_token": eos, "chat_template": template,
        "add_bos_token": bos is not None, "clean_up_tokenization_spaces": False, "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    stops = [tok.token_to_id(t) for t in LLAMA3_STOPS] if family == "llama3" else [tok.token_to_id(eos)]
    config = getattr(transformers, config_name)(**{
        **BASE, "vocab_size": tok.get_vocab_size(), "tie_word_embeddings": family == "llama3",
        "bos_token_id": tok.token_to_id(bos) if bos else None,
        "eos_token_id": stops if family == "llama3" else stops[0],
        **({"sliding_window": None} if family == "mistral" else {})})
    torch.manual_seed(seed)
    getattr(transformers, model_name)(config).eval().save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    assert config.model_type == model_type
    return path


def formatless_tokenizer() -> Tokenizer:
    """A tokenizer whose template writes the messages' text and nothing of tools, and that has no
    think tags."""
    backend = build_tokenizer(("<|eot|>",), ())
    return Tokenizer(backend, eos_token="<|eot|>", chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
