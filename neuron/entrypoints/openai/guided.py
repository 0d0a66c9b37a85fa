"""A request's structured output: `response_format`, a forced `tool_choice`, or vLLM's `guided_*`
fields, turned into one grammar and compiled off the event loop.

A forced tool call is constrained to the format the response parser reads: the model family's own
(Qwen's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Llama 3.1's JSON, Mistral's
`[TOOL_CALLS]`), or for a model with none, the call's JSON alone (vLLM's way for any model: the
arguments object of a named function, or a list of `{"name", "parameters"}` for "required"), with
the tools' parameter schemas, so the reply comes back as `tool_calls`.
"""

from __future__ import annotations

import json

import anyio

from neuron.engine.engine_client import EngineClient
from neuron.engine.sampling_params import GrammarError, GuidedDecodingParams
from neuron.engine.structured_output import CompiledGrammar
from neuron.entrypoints.openai.api_errors import bad_request
from neuron.entrypoints.openai.api_types import SamplingRequest
from neuron.entrypoints.openai.prompt_input import off_loop
from neuron.entrypoints.openai.response_parser import MISTRAL_CALLS, TOOL_CLOSE, TOOL_OPEN, tool_format

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# A tool call's JSON is compact, like the other JSON grammars, so a model cannot pad it forever.
_COMPACT = {"whitespace_flexible": False}


async def compile_guided(engine: EngineClient, req: SamplingRequest,
                         limiter: anyio.CapacityLimiter) -> CompiledGrammar | None:
    """The request's grammar compiled (in a worker thread, cached by the engine), or None when the
    request sets none. Anything wrong with it is a 400 naming the field it came from."""
    found = guided_params(req, engine.tokenizer)
    if found is None:
        return None
    guided, param = found
    if not engine.has_structured_output:
        raise bad_request("structured output needs the model's tokenizer.json", param=param)
    try:
        return await off_loop(limiter, engine.compile_grammar, guided)
    except GrammarError as exc:
        raise _renamed(exc, param) from None


def guided_params(req: SamplingRequest, tokenizer) -> tuple[GuidedDecodingParams, str] | None:
    """What the output must match and the request field that said so; None when unconstrained."""
    found = [(field, kind) for field, kind in _GUIDED_FIELDS.items() if getattr(req, field) is not None]
    fmt = req.response_format
    if fmt is not None and _format_type(fmt) != "text":
        found.append(("response_format", None))
    if _forces_tool(req):
        found.append(("tool_choice", None))
    if len(found) > 1:
        names = ", ".join(field for field, _ in found)
        raise bad_request(f"only one of {names} may constrain the output", param=found[1][0])
    if not found:
        return None
    field, kind = found[0]
    if field == "response_format":
        return _from_format(fmt)
    if field == "tool_choice":
        return _params("tools", grammar=_tool_grammar(req, tokenizer))
    return _params(field, **{kind: getattr(req, field)})


def _params(param: str, **spec) -> tuple[GuidedDecodingParams, str]:
    try:
        return GuidedDecodingParams(**spec), param
    except GrammarError as exc:
        raise _renamed(exc, param) from None


def _renamed(exc: GrammarError, param: str):
    """The 400 for a grammar error, speaking of the request's field rather than the engine's."""
    return bad_request(str(exc).replace(exc.param, param), param=param)


def _format_type(fmt) -> str:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                          param="response_format.type")
    return kind


def _from_format(fmt: dict) -> tuple[GuidedDecodingParams, str]:
    if fmt["type"] == "json_object":
        return _params("response_format", json_object=True)
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise bad_request("response_format of type json_schema needs json_schema.schema, a JSON schema object",
                          param="response_format.json_schema.schema")
    return _params("response_format.json_schema.schema", json=schema)


def _forces_tool(req) -> bool:
    """Whether tool_choice forces a call: "required" (any of the tools) or a function by its name
    (`named_tool`); not "none" or "auto" (the model decides). A malformed choice is a 400."""
    choice = getattr(req, "tool_choice", None)
    if choice in (None, "auto", "none"):
        return False
    if choice == "required":
        name = "required"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("tool_choice.function.name must be a function's name", param="tool_choice")
    else:
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}', param="tool_choice")
    if not req.tools:
        raise bad_request(f"tool_choice {name!r} needs tools", param="tool_choice")
    return True


def named_tool(req) -> str | None:
    """The function a named tool_choice names; None for any other choice."""
    choice = getattr(req, "tool_choice", None)
    return choice["function"]["name"] if isinstance(choice, dict) else None


def _tool_grammar(req, tokenizer) -> str:
    """Tool calls as a Lark grammar (llguidance's dialect, `%json` for a call's JSON), in the format
    the model's family writes and the response parser reads (`tool_format`): one call, or for
    "required" with parallel calls allowed, one or more. tags: each `<tool_call>\\n{...}\\n</tool_call>`;
    json: `{"name", "parameters"}` objects separated by `;`; mistral: `[TOOL_CALLS]` and a list;
    none (a model without a format): the arguments alone, or a list of `{"name", "parameters"}`."""
    tools = function_tools(req.tools)
    name = named_tool(req)
    if name is not None:
        if name not in tools:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools",
                              param="tool_choice")
        tools = {name: tools[name]}
    fmt = tool_format(tokenizer) if tokenizer is not None else "tags"
    if fmt is None and name is not None:
        return f"start: %json {json.dumps(_compact(tools[name]))}\n"
    key = "parameters" if fmt in ("json", None) else "arguments"
    rules = [f"call_{i}: %json {json.dumps(_call_schema(fn, params, key))}"
             for i, (fn, params) in enumerate(tools.items())]
    calls = " | ".join(f"call_{i}" for i in range(len(rules)))
    repeat = name is None and req.parallel_tool_calls is not False
    if fmt is None:
        start, call = ('start: "[" call ("," call)* "]"' if repeat else 'start: "[" call "]"'), f"call: {calls}"
    elif fmt == "mistral":
        body = 'call ("," call)*' if repeat else "call"
        start, call = f'start: {_tag(MISTRAL_CALLS, tokenizer)} "[" {body} "]"', f"call: {calls}"
    elif fmt == "json":
        start, call = ('start: call (";" call)*' if repeat else "start: call"), f"call: {calls}"
    else:
        start = 'start: call ("\\n" call)*' if repeat else "start: call"
        call = f'call: {_tag(TOOL_OPEN, tokenizer)} "\\n" ({calls}) "\\n" {_tag(TOOL_CLOSE, tokenizer)}'
    return "\n".join([start, call, *rules]) + "\n"


def _call_schema(name: str, params: dict, key: str = "arguments") -> dict:
    """The JSON of one call to `name`, a schema of its own. The parameters' definitions move to its
    root, where their `#/$defs/...` references point (pydantic writes nested models so)."""
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    arguments = {k: v for k, v in params.items() if k not in defs}
    return _compact({"type": "object", "properties": {"name": {"const": name}, key: arguments},
                     "required": ["name", key], "additionalProperties": False, **defs})


def _compact(schema: dict) -> dict:
    return {**schema, "x-guidance": _COMPACT}


def _tag(tag: str, tokenizer) -> str:
    """A tag the tokenizer holds as one token is that token, as the model writes it; else its text."""
    token_id = tokenizer.token_to_id(tag) if tokenizer is not None else None
    return f"<[{token_id}]>" if token_id is not None else json.dumps(tag)


def function_tools(tools: list) -> dict[str, dict]:
    """Each function's name and parameter schema (no parameters: any object); a tool not of
    OpenAI's function shape, or a name used twice, is a 400 naming the tool."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name or tool.get("type", "function") != "function":
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                              '...}}', param=f"tools[{i}]")
        if not isinstance(fn.get("description", ""), str | None):
            raise bad_request(f"tools[{i}].function.description must be a string",
                              param=f"tools[{i}].function.description")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              param=f"tools[{i}].function.parameters")
        if name in out:
            first = next(j for j, t in enumerate(tools) if t["function"]["name"] == name)
            raise bad_request(f"tools[{i}] is named {name!r}, as tools[{first}] is: each tool needs a name of its own",
                              param=f"tools[{i}]")
        out[name] = params
    return out
