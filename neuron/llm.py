"""The offline API, in the convention users know from vLLM:

    with LLM(model="path-or-repo-id", tensor_parallel_size=2) as llm:
        outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=16))
"""

from __future__ import annotations

import atexit
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Sequence

from neuron.engine import EngineConfig, LLMEngine, encode_prompt
from neuron.errors import NeuronError
from neuron.sampling import SamplingParams


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False


PromptType = str | dict | list[int]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        tensor_parallel_size: int = 1,
        device: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        download_dir: str | None = None,
        block_size: int | None = None,
        kv_cache_memory: int | str | None = None,
        gpu_memory_utilization: float | None = None,
        enable_prefix_caching: bool | None = None,
        **kwargs,
    ):
        if kwargs:
            raise TypeError(f"LLM() got unsupported arguments: {', '.join(sorted(kwargs))}")
        cfg = EngineConfig(model=model, tp=tensor_parallel_size, device=device, dtype=dtype,
                           max_model_len=max_model_len, max_num_seqs=max_num_seqs, hf_cache_dir=download_dir,
                           block_size=block_size, kv_cache_memory=kv_cache_memory,
                           gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=enable_prefix_caching)
        self.engine = LLMEngine(cfg).start()
        self._ids = itertools.count()
        self._finalizer = weakref.finalize(self, _shutdown_engine, self.engine)
        atexit.register(self._finalizer)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs in prompt order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        tokenized = [self._tokenize(prompt) for prompt in prompts]
        for (_, ids), p in zip(tokenized, params_list):  # refuse the whole call before queueing any of it
            if p.n != 1:
                raise ValueError("n > 1 is not supported; pass the prompt several times instead")
            self.engine.validate(ids, p)
        if self.engine.failure is not None:  # a rank died since the last call: bring the ranks back first
            self.engine.recover()
        outputs: dict[str, RequestOutput] = {}
        order = []
        for (text, ids), p in zip(tokenized, params_list):
            rid = str(next(self._ids))
            self.engine.add_request(rid, ids, p)
            logprobs = [] if p.logprobs is not None else None
            outputs[rid] = RequestOutput(rid, text, ids, [CompletionOutput(0, "", [], None, logprobs, None)])
            order.append(rid)
        self._run(outputs)
        return [outputs[rid] for rid in order]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             **template_kwargs) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self._need_tokenizer()
        prompts = [tok.apply_chat_template(c, add_generation_prompt=True, **template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, encode_prompt(self.engine, prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], encode_prompt(self.engine, prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return None, list(prompt)

    def _need_tokenizer(self):
        if self.engine.tokenizer is None:
            raise NeuronError("this checkpoint has no tokenizer.json")
        return self.engine.tokenizer

    def _run(self, outputs: dict[str, RequestOutput]) -> None:
        pending = len(outputs)
        while pending:
            for u in self.engine.step():
                out = outputs.get(u.request_id)
                if out is None:
                    continue
                c = out.outputs[0]
                c.token_ids.extend(u.token_ids)
                c.text += u.text
                if u.logprobs is not None:
                    c.logprobs.extend(u.logprobs)
                if u.finished:
                    out.finished = True
                    c.finish_reason, c.stop_reason = u.finish_reason, u.stop_reason
                    if c.logprobs:
                        c.cumulative_logprob = sum(lp[t] for lp, t in zip(c.logprobs, c.token_ids))
                    pending -= 1
                    if u.error:
                        raise NeuronError(f"generation failed: {u.error}")

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _shutdown_engine(engine: LLMEngine) -> None:
    engine.shutdown()
