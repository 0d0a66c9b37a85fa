"""The streaming offline API, in the convention users know from vLLM's AsyncLLM: requests from an
asyncio program, each an async iterator of RequestOutputs while the engine runs them together.

    async with AsyncLLM(model="path-or-repo-id", tensor_parallel_size=2) as llm:
        async for out in llm.generate("Hello", SamplingParams(max_tokens=16), request_id="a"):
            print(out.outputs[0].text)

The engine runs in a thread of its own (the server's AsyncEngine), so the event loop stays free
while the ranks step; tokenizing a prompt and compiling its grammar run in worker threads too.
What each request yields follows its `SamplingParams.output_kind`: everything so far at each
step (CUMULATIVE, the default), what the step added (DELTA), or the finished output alone
(FINAL_ONLY). A request whose iterator is closed or cancelled, or that `abort` names, stops
running at the next step; a failure of the ranks raises NeuronError from the iterator, and the
engine rebuilds them for the requests after.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import replace

import torch

from neuron.engine.async_engine import AsyncEngine, EngineState, NotReady, Overloaded
from neuron.engine.llm_engine import Update, interruptible_load
from neuron.engine.lora import LoRARequest
from neuron.engine.parallel_sampling import sample_id, sample_params
from neuron.engine.pooling import PoolingParams
from neuron.engine.request_stream import RequestStream
from neuron.engine.sampling_params import RequestOutputKind, SamplingParams
from neuron.entrypoints.llm import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    PromptType,
    RequestOutput,
    _apply,
    _keep_best,
    _Prompt,
    apply_update,
    engine_config,
    token_decoder,
    tokenized_prompt,
    truncated_prompt,
)
from neuron.entrypoints.openai.streaming import merged_updates
from neuron.entrypoints.serve import served_name
from neuron.errors import NeuronError

# Requests that may wait for a place beyond the running ones before `generate` refuses one.
_MAX_WAITING = 4096
_QUIET_S = 3600.0  # merged_updates' keep-alive, which nothing here uses


class AsyncLLM:
    """`engine_args`: those of neuron.entrypoints.llm.engine_config (vLLM's names). Start it with
    `async with`, or `await llm.start()` and `await llm.shutdown_async()` (or `shutdown()` from a
    thread without a running loop)."""

    def __init__(self, model: str | None = None, **engine_args):
        cfg, self._seed = engine_config(model, **engine_args)
        load, interrupt = interruptible_load(cfg)
        self.engine = AsyncEngine(load, model_name=served_name(cfg), max_running=cfg.max_num_seqs,
                                  max_waiting=_MAX_WAITING, interrupt=interrupt)
        self._ids = itertools.count()
        self._requests: dict[str, list[RequestStream]] = {}

    async def start(self) -> "AsyncLLM":
        """Load the model (in the engine's thread) and return once it serves; NeuronError if it
        cannot load."""
        if self._seed is not None:  # the draws of requests without a seed come from the global generator
            torch.manual_seed(self._seed)
        self.engine.start()
        while self.engine.state is EngineState.LOADING:
            await asyncio.sleep(0.05)
        if self.engine.state is not EngineState.READY:
            raise NeuronError(f"the model did not load: {self.engine.error or self.engine.state.value}")
        return self

    async def __aenter__(self) -> "AsyncLLM":
        try:
            return await self.start()
        except BaseException:
            await self.shutdown_async()
            raise

    async def __aexit__(self, *exc) -> None:
        await self.shutdown_async()

    def shutdown(self) -> None:
        """Stop the engine and its ranks; blocks (`shutdown_async` from the event loop)."""
        self.engine.stop()

    async def shutdown_async(self) -> None:
        for request_id in list(self._requests):
            await self.abort(request_id)
        await asyncio.to_thread(self.engine.stop)

    def get_tokenizer(self):
        return self._loaded().tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json over SamplingParams' own defaults, as LLM's."""
        return SamplingParams(**self._loaded().model.default_sampling())

    @property
    def is_running(self) -> bool:
        """Whether it takes requests: loaded, and not failed or shutting down."""
        return self.engine.state in (EngineState.READY, EngineState.RECOVERING)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """One prompt's RequestOutputs as it runs (its `n` samples together, `outputs[i].index ==
        i`), as `sampling_params.output_kind` says; the last has `finished` set. `request_id`: the
        name `abort` takes (a fresh one when left out; one in use is a ValueError). A prompt,
        sampling params or adapter the model cannot take raises before anything runs."""
        params = sampling_params or self.get_default_sampling_params()
        if params.best_of is not None and params.best_of > params.n \
                and params.output_kind is not RequestOutputKind.FINAL_ONLY:
            raise ValueError("best_of > n returns the best samples, known only when all have finished: send "
                             "output_kind=RequestOutputKind.FINAL_ONLY")
        rid = self._reserve(request_id)  # taken from now, while its prompt is tokenized
        try:
            streams, tokenized, children = await self._open(rid, prompt, params, lora_request)
            self._requests[rid] = streams
            async for out in self._outputs(rid, streams, tokenized, params, children):
                yield out
        finally:
            for stream in self._requests.pop(rid):
                stream.close()

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[PoolingRequestOutput]:
        """One prompt's pooled output, as vLLM's `AsyncLLM.encode` yields it, once: `outputs.data`
        the embedding of a model served to embed, or the label probabilities of a classifier
        (LLM.classify's; its logits with `pooling_params.use_activation` false). `request_id` as
        `generate`'s; a prompt the model cannot take, or a model that pools nothing, raises before
        anything runs; one that `abort` ends yields nothing."""
        rid = self._reserve(request_id)
        try:
            engine = self._loaded()
            pooling = engine.model.pooling
            if pooling is None:
                raise NeuronError("this model pools nothing: load an embedding or classification model (task "
                                  "\"embed\" or \"classify\")")
            params = pooling_params or PoolingParams()
            tokenized = await asyncio.to_thread(
                lambda: truncated_prompt(engine, tokenized_prompt(engine, prompt, pooling=True),
                                         params.truncate_prompt_tokens))
            if tokenized.images:
                raise ValueError("encode takes text or token ids, not images")
            engine.inputs.admit_pooling(tokenized.ids, tokenized.types_from)
            try:
                stream = self.engine.open(rid, tokenized.ids, params, cache_salt=tokenized.cache_salt,
                                          types_from=tokenized.types_from)
            except (NotReady, Overloaded) as exc:
                raise NeuronError(f"the request cannot run now: {exc}") from None
            self._requests[rid] = [stream]
            async for batch in merged_updates([stream], _QUIET_S):
                for _, update in batch or ():
                    if update.finish_reason == "error":
                        raise NeuronError(f"pooling failed: {update.error}")
                    if update.finished and update.finish_reason != "abort":
                        vector = update.embedding
                        if pooling.classifier is not None and params.use_activation is not False:
                            vector = pooling.classifier.probabilities(vector)
                        yield PoolingRequestOutput(rid, PoolingOutput(torch.tensor(vector)), tokenized.ids)
        finally:
            for stream in self._requests.pop(rid):
                stream.close()

    def _reserve(self, request_id: str | None) -> str:
        """The request's id, taken from now: the caller's, or the next of ours that no caller
        took; one in use is a ValueError."""
        if request_id is None:
            rid = next(r for r in (f"request-{n}" for n in self._ids) if r not in self._requests)
        elif request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is in use by a running request")
        else:
            rid = request_id
        self._requests[rid] = []
        return rid

    async def abort(self, request_id: str) -> None:
        """End a running request at the next step: its iterator yields a last output (finish reason
        `abort`, unless a sample had finished already) and stops. An unknown id does nothing."""
        for stream in self._requests.get(request_id, ()):
            if not stream.finished and not stream.closed:
                stream.close()  # the engine drops it
                stream.put(Update(stream.request_id, [], "", None, True, "abort"))

    async def _open(self, rid: str, prompt: PromptType, params: SamplingParams,
                    lora_request: LoRARequest | None) -> tuple[list[RequestStream], _Prompt, list[SamplingParams]]:
        """Every sample of the prompt queued, or none: all checked before the first is queued."""
        engine = self._loaded()
        tokenized = await asyncio.to_thread(
            lambda: truncated_prompt(engine, tokenized_prompt(engine, prompt), params.truncate_prompt_tokens))
        lora = None
        if lora_request is not None:
            if engine.loras is None:
                raise NeuronError("LoRA requests need AsyncLLM(..., enable_lora=True)")
            lora = (await asyncio.to_thread(engine.loras.resolve, lora_request)).name
        grammar = None
        if params.guided_decoding is not None:
            if not self.engine.has_structured_output:
                raise NeuronError("structured output needs the model's tokenizer.json")
            grammar = await asyncio.to_thread(self.engine.compile_grammar, params.guided_decoding)
        children = sample_params(params)
        self.engine.validate(tokenized.ids, children[0], tokenized.images)
        streams: list[RequestStream] = []
        try:
            for i, child in enumerate(children):
                streams.append(self.engine.open(sample_id(rid, i, len(children)), tokenized.ids, child,
                                                tokenized.images, i == 0, grammar, tokenized.cache_salt, lora))
        except BaseException as exc:
            for stream in streams:
                stream.close()
            if isinstance(exc, (NotReady, Overloaded)):
                raise NeuronError(f"the request cannot run now: {exc}") from None
            raise
        return streams, tokenized, children

    async def _outputs(self, rid: str, streams: list[RequestStream], tokenized: _Prompt, params: SamplingParams,
                       children: list[SamplingParams]) -> AsyncIterator[RequestOutput]:
        """The request's outputs as `params.output_kind` says, from its samples' updates as they come
        (`children`: each sample's params, which ask for logprobs where best_of ranks them)."""
        out = RequestOutput(rid, tokenized.text, tokenized.ids, [_empty(i, child) for i, child in enumerate(children)])
        decode = token_decoder(self.engine.tokenizer)
        kind = params.output_kind
        async for batch in merged_updates(streams, _QUIET_S):
            deltas: dict[int, CompletionOutput] = {}
            for k, update in batch or ():
                if update.finish_reason == "error":
                    raise NeuronError(f"generation failed: {update.error}")
                apply_update(out, k, update, decode)
                if kind is RequestOutputKind.DELTA:
                    _apply(deltas.setdefault(k, _empty(k, children[k])), update, decode)
            if not batch:
                continue
            out.finished = all(c.finish_reason is not None for c in out.outputs)
            if kind is RequestOutputKind.CUMULATIVE:
                yield replace(out, outputs=[_copy(c) for c in out.outputs])
            elif kind is RequestOutputKind.DELTA:
                for k, c in deltas.items():
                    c.cumulative_logprob = out.outputs[k].cumulative_logprob
                yield replace(out, outputs=[deltas[k] for k in sorted(deltas)])
        if kind is RequestOutputKind.FINAL_ONLY:
            _keep_best(out, params)
            yield out

    def _loaded(self):
        if self.engine.engine is None or self.engine.state not in (EngineState.READY, EngineState.RECOVERING):
            raise NeuronError(f"the engine is not running ({self.engine.state.value}): start it first "
                              "(`async with AsyncLLM(...)` or `await llm.start()`)")
        return self.engine.engine


def _empty(index: int, params: SamplingParams) -> CompletionOutput:
    return CompletionOutput(index, "", [], None, [] if params.logprobs is not None else None, None)


def _copy(c: CompletionOutput) -> CompletionOutput:
    """A sample's output as it stands, for a caller to keep while the request runs on."""
    return replace(c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs))
