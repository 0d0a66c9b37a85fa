"""The engine: owns the ranks, schedules requests, samples, and feeds its output processor.

Only the engine's own thread talks to the ranks. Other threads submit and abort requests through
a thread-safe inbox that is read at step boundaries, so a cancelled request leaves between steps
and the ranks never see half a step.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

from neuron.engine import pooling, prompt_logprobs
from neuron.engine.block_manager import BlockManager, salt_key
from neuron.engine.engine_config import EngineConfig, parse_lora_modules
from neuron.engine.input_processor import InputProcessor, RequestError, check_cache_salt
from neuron.engine.loading import load_within
from neuron.engine.lora import Adapter, LoraSlots
from neuron.engine.model_config import ModelConfig, resolve_model_config
from neuron.engine.output_processor import OutputProcessor, Update
from neuron.engine.pooling import PoolingParams
from neuron.engine.sampling import SampleFailure, SequenceSampler, TokenBitmask, bad_words_token_ids, sample
from neuron.engine.sampling_params import SamplingParams
from neuron.engine.scheduler import Scheduled, Scheduler
from neuron.engine.sequence import Sequence
from neuron.engine.spec_decode import SpecDecoder
from neuron.engine.structured_output import CompiledGrammar, StructuredOutput
from neuron.engine.tokenizer import TokenizerError
from neuron.errors import WorkerError
from neuron.executor.executor import Executor
from neuron.multimodal.image import ImageError, ImageInput, VisionSpec, image_spans
from neuron.step import SeqStep, StepImage
from neuron.utils.device import to_device

log = logging.getLogger("neuron.engine.llm_engine")


class LLMEngine:
    def __init__(self, model: ModelConfig | EngineConfig, worker_cmd=None):
        """The engine of one model: `model` resolved (engine/model_config.py), or the arguments to
        resolve it from. Nothing runs until `start`."""
        self.model = model = model if isinstance(model, ModelConfig) else resolve_model_config(model)
        self.model_name, self.tokenizer = model.name, model.tokenizer
        self.max_model_len, self.vocab_size = model.max_model_len, model.vocab_size
        self.loras = LoraSlots(model.spec.max_loras, model.spec.max_lora_rank, model.hf_config) \
            if model.spec.enable_lora else None
        for name, path in parse_lora_modules(model.spec.lora_modules):
            self.loras.register(name, path)  # a bad adapter stops the load, naming it
        self.scheduler = Scheduler(model.spec.max_num_seqs, model.step_tokens, model.spec.prefill_chunk_tokens,
                                   max_image_bytes=lambda: self.executor.max_image_bytes, loras=self.loras,
                                   whole_prompts=model.encoder)
        self.spec = SpecDecoder(model.speculative, model) if model.speculative is not None else None
        self.executor = Executor(model.executor_config(), **({"worker_cmd": worker_cmd} if worker_cmd else {}))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._shut_down = threading.Event()
        eos = list(model.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, eos, self.max_model_len)
        self.structured = StructuredOutput(self.tokenizer, self.vocab_size, eos) if self.tokenizer is not None else None
        devices = self.executor.devices
        self.inputs = InputProcessor(self.max_model_len, self.vocab_size, eos, model.vision, self.structured,
                                     lambda: self.executor.max_image_bytes, devices[0], model.spec.dtype,
                                     devices.count(devices[0]), frame=_frame(model),
                                     token_types=model.token_types)

    def start(self, phases: Callable[[str], None] = lambda what: None) -> "LLMEngine":
        self.executor.start(phases)
        self._new_blocks()
        return self

    @classmethod
    def load(cls, cfg: EngineConfig | ModelConfig, worker_cmd=None,
             building: Callable[["LLMEngine"], None] | None = None) -> "LLMEngine":
        """A started engine, its model resolved (unless `cfg` is resolved already) and its ranks up
        within load_timeout_s (loading.LoadTimeout naming the phase otherwise). `building(engine)`
        hears of the engine before it starts (to interrupt it)."""
        made: list[LLMEngine] = []
        spec = cfg.spec if isinstance(cfg, ModelConfig) else cfg

        def build(phases) -> LLMEngine:
            model = cfg if isinstance(cfg, ModelConfig) else resolve_model_config(cfg, phases)
            phases("reading the weight index and planning memory")
            engine = cls(model, worker_cmd)
            made.append(engine)
            if building is not None:
                building(engine)
            return engine.start(phases)

        def interrupt(reason: str) -> None:
            if made:
                made[0].executor.abort(reason)

        return load_within(build, spec.load_timeout_s, interrupt, close=lambda engine: engine.shutdown(),
                           hold=lambda engine: engine._shut_down.wait())

    def _new_blocks(self) -> None:
        """A block manager over the pool the ranks just allocated (empty: a new pool holds nothing),
        and adapter slots that hold nothing either."""
        if self.loras is not None:
            self.loras.reset()
        self.scheduler.use_blocks(BlockManager(self.executor.num_kv_blocks, self.executor.shard.block_size,
                                               self.model.prefix_caching))
        if self.spec is not None:
            # a draft's pool mirrors the target's; its cost is priced against a target rank's weights
            self.spec.start(self.executor.num_kv_blocks, max(self.executor.weight_bytes))

    # ---- requests (any thread) ----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                    images: list[ImageInput] | None = None, grammar: CompiledGrammar | None = None,
                    cache_salt: str | None = None, lora: str | None = None, types_from: int | None = None) -> None:
        """Queue a request (checked first by `inputs`, the InputProcessor). With images, the prompt's
        placeholders are already expanded (`inputs.expand_images`) and must hold each image's run of
        tokens, in order. `grammar`: the
        params' structured output, compiled already (else it is compiled here). `cache_salt`: the
        request shares cached prefix blocks only with requests of the same salt (None: unsalted).
        With PoolingParams the request is an embedding: its prompt is prefilled like any other,
        batched with the rest, and its final update carries the pooled vector (`Update.embedding`).
        `lora`: the name of a registered LoRA adapter (`self.loras`) the request runs; its cached
        prefix blocks are the adapter's own. `types_from`: an encoder's input of two texts (a
        cross-encoder's pair, Tokenizer.join_pair), the position from which its tokens are of the
        second token type; None: all of the first."""
        check_cache_salt(cache_salt)
        adapter = _named_adapter(self.loras, lora, self.model_name)
        _check_task(self.model, params)
        if types_from is not None and not isinstance(params, PoolingParams):
            raise RequestError("token types are an encoder's, and it generates nothing", param="token_type_ids")
        if isinstance(params, PoolingParams):
            self.inputs.admit_pooling(prompt_token_ids, types_from)
            pooled, pooled_by = pooling.Pooled(params.dimensions, params.use_activation), self.model.pooling
            max_tokens, matcher = 0, None
            params = SamplingParams(temperature=0.0, max_tokens=0)  # prefill only
        else:
            pooled = pooled_by = None
            max_tokens, matcher = self.inputs.admit(prompt_token_ids, params, images, grammar)
        bad = None
        if params.bad_words:
            if self.tokenizer is None:
                raise RequestError("bad_words needs the model's tokenizer, which it has not", param="bad_words")
            bad = bad_words_token_ids(self.tokenizer, params.bad_words)
        sampler = SequenceSampler(params, prompt_token_ids, self.vocab_size, self.executor.devices[0], bad)
        salt = salt_key(cache_salt) if adapter is None else adapter.cache_key(salt_key(cache_salt))
        seq = Sequence(request_id, list(prompt_token_ids), params, sampler, max_tokens, images=list(images or []),
                       grammar=matcher, cache_salt=salt, pooling=pooled_by, pooled=pooled, lora=adapter,
                       types_from=types_from)
        self._inbox.put(("add", seq))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    # ---- the loop (engine thread only) ----

    def has_unfinished(self) -> bool:
        """Requests to run, or LoRA adapters (unloaded or resting) for the ranks to forget."""
        return (self.scheduler.has_work() or not self._inbox.empty()
                or bool(self.loras and (self.loras.forgets or self.loras.rests)))

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def _drain_inbox(self) -> list[Update]:
        updates = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return updates
            if kind == "add":
                self.outputs.add(item)
                self.scheduler.add(item)
            elif (seq := self.outputs.sequence(item)) is not None:
                self.scheduler.finish(seq, "abort")
                updates.append(self.outputs.end(seq))

    def step(self) -> list[Update]:
        """Admit and abort what arrived, then schedule, execute, update the scheduler, sample, and
        propose the next step's draft tokens. A rank failure ends every request in flight; any other
        fault ends only the requests it touched."""
        updates = self._drain_inbox()
        if self.loras is not None:
            self.loras.forget(self.executor)
        batch = self.scheduler.schedule()
        if not batch:
            return updates
        logits, ran = self._execute(batch, updates)
        if ran:
            rows, scored = self.scheduler.update_from_output(ran)
            updates += [self.outputs.end(seq) for seq in scored]  # prompt scored or pooled, nothing to generate
            updates += self._sample_step([ran[i] for i in rows], logits, [ran[i].logits for i in range(len(ran))], rows)
        if self.spec is not None and self.failure is None:
            self.spec.propose(self.scheduler)
        return updates

    def _sample_step(self, ready: list[Scheduled], logits: torch.Tensor, counts: list[int],
                     rows: list[int]) -> list[Update]:
        """Sample the sequences whose logits are due (`rows` of the step's, each with `counts[i]`
        rows of logits); a verifying step through speculative decoding's acceptance."""
        if not ready:
            return []
        if not any(s.proposal for s in ready):
            return self._sample(ready, _rows(logits, rows))
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        ours = _rows(logits, [r for i in rows for r in range(starts[i], starts[i + 1])])
        return self.spec.verify(ready, ours, self.scheduler, lambda part, idx: self._sample(part, _rows(ours, idx)))

    def _execute(self, batch: list[Scheduled], updates: list[Update]) -> tuple[torch.Tensor | None, list[Scheduled]]:
        """Run the step's forward; the logits and the scheduled sequences they belong to, in row
        order. A failed forward's requests end (into `updates`)."""
        try:
            return self._forward(batch), batch
        except Exception as exc:  # noqa: BLE001 - contained: a rank failure or only this step's requests
            if self.failure is not None:  # the ranks are out of step: nothing in flight can go on
                updates += self.fail_in_flight(str(exc))
                return None, []
            # Every rank refused or failed it alike (a request the ranks reject, a bug on the
            # leader's side): the ranks are in step, and only its own sequences end. Nothing of it
            # was marked computed, so no block it wrote enters the prefix cache.
            seqs = [s.seq for s in batch]
            updates += (self._fail(seqs, str(exc)) if isinstance(exc, WorkerError)  # the ranks' own message
                        else self._fail(seqs, _internal("running the model", exc), "internal_error", exc))
            return None, []

    def _forward(self, part: list[Scheduled]) -> torch.Tensor:
        if self.loras is not None:  # the adapter slots the scheduler assigned, filled before the step needs them
            self.loras.fill(self.executor)
        steps = _steps(part, self.model.vision)
        if all(st.prompt_logprobs is None and st.pool is None for st in steps):
            return self.executor.step(steps)
        result = self.executor.run_step(steps)
        prompt_logprobs.accumulate(part, result)
        pooling.accumulate(part, steps, result)
        return result.logits

    def _sample(self, ready: list[Scheduled], logits: torch.Tensor) -> list[Update]:
        """Sample every ready sequence and advance it; a fault in one sequence ends it alone."""
        try:
            result = sample(logits, [s.seq.sampler for s in ready], self.model.eos_token_ids, self._allowed(ready))
        except Exception as exc:  # noqa: BLE001 - contained: each row is retried alone
            # Not a row the sampler could name: find it by sampling each row alone. A seeded row
            # drawn before the fault may draw again, so its token can differ from a clean step's.
            log.warning("sampling a batch of %d failed (%s: %s); sampling each sequence alone",
                        len(ready), type(exc).__name__, exc)
            return [self._sample_alone(s, logits[i : i + 1]) for i, s in enumerate(ready)]
        return [self._advance_or_fail(s, token, lp, result.failed.get(i), rank)
                for i, (s, token, lp, rank) in enumerate(zip(ready, result.token_ids, result.logprobs, result.ranks,
                                                              strict=True))]

    def _sample_alone(self, s: Scheduled, row: torch.Tensor) -> Update:
        try:
            result = sample(row, [s.seq.sampler], self.model.eos_token_ids, self._allowed([s]))
        except Exception as exc:  # noqa: BLE001 - contained: this sequence alone ends
            return self._fail([s.seq], _internal("sampling", exc), "internal_error", exc)[0]
        return self._advance_or_fail(s, result.token_ids[0], result.logprobs[0], result.failed.get(0), result.ranks[0])

    def _allowed(self, ready: list[Scheduled]) -> TokenBitmask | None:
        """The grammar masks of the sequences with structured output, one call for the batch."""
        if self.structured is None:
            return None
        return self.structured.allowed_tokens([s.seq.grammar for s in ready])

    def _advance_or_fail(self, s: Scheduled, token: int, logprobs: dict[int, float] | None,
                         failure: SampleFailure | None, rank: int | None = None) -> Update:
        if failure is not None:
            kind = "invalid_request" if failure.by_request else "internal_error"
            return self._fail([s.seq], failure.message, kind)[0]
        seq = s.seq
        try:
            if not self.scheduler.advance(seq, token):  # a grammar past its limits, mid-way
                return self._fail([seq], f"structured output failed: {seq.grammar.error}", "invalid_request")[0]
            update = self.outputs.process(seq, token, logprobs, rank)
        except Exception as exc:  # noqa: BLE001 - contained: this sequence alone ends
            return self._fail([seq], _internal("processing the output", exc), "internal_error", exc)[0]
        if update.finished:
            self.scheduler.finish(seq, update.finish_reason, update.stop_reason)
            if self.spec is not None:
                self.spec.finished(seq)
        return update

    def _fail(self, seqs: list[Sequence], message: str, kind: str | None = None,
              exc: BaseException | None = None) -> list[Update]:
        """End these requests with an error, logged once (with the traceback of `exc`, a bug); their
        slots and blocks return to the scheduler. `kind` tells the client whose fault it was
        (`Update.failure_kind`); None: a failing rank."""
        if seqs:
            ids = ", ".join(seq.request_id for seq in seqs)
            log.error("failing %d request(s) [%s]: %s", len(seqs), ids, message, exc_info=exc)
        updates = []
        for seq in seqs:
            self.scheduler.finish(seq, "error")
            updates.append(self.outputs.end(seq, error=message, failure_kind=kind))
        return updates

    @property
    def failure(self) -> str | None:
        """Why the ranks cannot run steps (a worker died, a step missed its deadline), else None."""
        return self.executor.failure

    def on_failure(self, callback) -> None:
        """`callback(reason)` runs (on another thread) the moment a rank dies, even between steps."""
        self.executor.on_failure = callback

    def recover(self) -> list[Update]:
        """Fail what is in flight, then tear the ranks down and bring them up again. Returns the
        failed requests' final updates; raises if the ranks cannot be brought back."""
        updates = self.fail_in_flight(f"recovering from: {self.failure}")
        self.restart()
        return updates

    def restart(self) -> None:
        """Kill and reap every rank and load the model again (nothing may be in flight). The new
        pool holds no KV, so the prefix cache starts empty."""
        self.executor.restart()
        self._new_blocks()

    def fail_in_flight(self, message: str) -> list[Update]:
        """End every admitted request with an error; their slots return to the free list."""
        return self._fail(self.scheduler.all_sequences(), message)

    def footprint(self) -> dict:
        """Where the model runs and what it holds, as /v1/models and /admin/models show it."""
        return {"tp": self.model.spec.tp, "devices": list(self.executor.devices),
                "quantization": self.model.quantization, "max_model_len": self.max_model_len,
                "weight_bytes": sum(self.executor.weight_bytes)}

    def kv_slot_usage(self) -> float:
        return len(self.scheduler.running) / self.scheduler.max_num_seqs

    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by sequences."""
        return self.scheduler.blocks.usage()

    def prefix_cache_counts(self) -> tuple[int, int]:
        """Prompt tokens looked up in the prefix cache and those found, since start (cumulative)."""
        return self.scheduler.prefix_cache_queries, self.scheduler.prefix_cache_hits

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.spec is not None:
            self.spec.close()
        self._shut_down.set()


def _steps(part: list[Scheduled], vision: VisionSpec | None) -> list[SeqStep]:
    """The step records of the scheduled sequences, for every rank."""
    return [SeqStep(s.seq.slot, s.token_ids, s.offset, s.new_blocks, s.fresh, prompt_logprobs.wanted(s), s.logits,
                    _step_images(s, vision), pooling.wanted(s), -1 if s.seq.lora_slot is None else s.seq.lora_slot,
                    s.seq.types_from)
            for s in part]


def _step_images(s: Scheduled, vision: VisionSpec | None) -> list[StepImage]:
    """A sequence's images, on its first step in its slot: each one's URI and where its
    placeholders start in the prompt (checked against its images when the request came in)."""
    if not (s.fresh and s.seq.images):
        return []
    images = s.seq.images
    spans = image_spans(s.seq.prompt_token_ids, vision.image_token_id, [i.num_tokens for i in images])
    return [StepImage(image.uri, start) for image, (start, _) in zip(images, spans)]


def _named_adapter(loras: LoraSlots | None, name: str | None, model_name: str) -> Adapter | None:
    """The registered adapter a request names (None: the base model); refused when there is none."""
    if name is None:
        return None
    adapter = loras.adapters.get(name) if loras is not None else None
    if adapter is None:
        served = "" if loras is None else f" (loaded: {', '.join(sorted(loras.adapters)) or 'none'})"
        raise RequestError(f"model `{model_name}` has no LoRA adapter named {name!r}{served}", param="model")
    return adapter


def _check_task(model: ModelConfig, params: SamplingParams | PoolingParams) -> None:
    """Refuse a generation from a model served for pooling only, a pooling from one served for
    generation only (`--task`), an embedding from a classifier or a classification from an
    embedding model, or an embedding cut to more dimensions than it has."""
    if isinstance(params, SamplingParams) and pooling.GENERATE not in model.tasks:
        if pooling.CLASSIFY in model.tasks:
            raise RequestError(f"model `{model.name}` is a classification model: it serves /classify, /score and "
                               "/rerank, not generation", param="model")
        both = "an encoder, it generates nothing" if model.encoder else \
            "serve it with --task generate,embed to allow both"
        raise RequestError(f"model `{model.name}` is an embedding model: it serves /v1/embeddings, not generation "
                           f"({both})", param="model")
    if not isinstance(params, PoolingParams):
        return
    if model.pooling is None:
        raise RequestError(f"model `{model.name}` is a generation model: it does not serve embeddings (serve an "
                           "embedding model, or this one with --task generate,embed)", param="model")
    if params.task is not None and params.task not in model.tasks:
        served = "classifies" if pooling.CLASSIFY in model.tasks else "embeds"
        raise RequestError(f"model `{model.name}` {served}: it is not served for {params.task} (--task "
                           f"{','.join(sorted(model.tasks))})", param="model")
    if params.dimensions is not None and model.classifier is not None:
        raise RequestError("dimensions applies to embeddings, not a classifier's logits", param="dimensions")
    if params.dimensions is not None and not 0 < params.dimensions <= model.hidden_size:
        raise RequestError(f"dimensions must be in 1..{model.hidden_size} (this model's embedding size), got "
                           f"{params.dimensions}", param="dimensions")


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """These rows of `logits`. The index travels without blocking: indexing with a list would copy
    it from pageable memory, and the host would wait for the step's forward."""
    if len(rows) == logits.shape[0]:
        return logits
    return logits.index_select(0, to_device(rows, logits.device, torch.long))


def _internal(doing: str, exc: Exception) -> str:
    return f"internal error while {doing}: {type(exc).__name__}: {exc}"


def encode_prompt(engine: LLMEngine, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """A text prompt's ids with the special tokens the tokenizer's post-processor adds (Llama's and
    Mistral's BOS; nothing for Qwen's), as transformers and vLLM encode a completion's prompt
    (vLLM's `add_special_tokens` false leaves them out). A chat's template writes its own BOS, so
    rendered chats are encoded without them."""
    if engine.tokenizer is None:
        raise RequestError("this checkpoint has no tokenizer.json: send token ids instead of text", param="prompt")
    try:
        return engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    except TokenizerError as exc:  # a tokenizer that fails on this text (tokenizer._no_panic)
        raise RequestError(str(exc), param="prompt") from None


__all__ = ["EngineConfig", "ImageError", "LLMEngine", "PoolingParams", "RequestError", "Update", "encode_prompt"]


def interruptible_load(cfg: EngineConfig | ModelConfig) -> tuple[Callable[[], LLMEngine], Callable[[str], None]]:
    """A loader of `cfg`'s engine (LLMEngine.load) and, for another thread, a way to abort the ranks it
    is starting (a server stopping, a model unloaded while it loads) rather than wait for them."""
    building: list[LLMEngine] = []

    def interrupt(reason: str) -> None:
        if building:
            building[0].executor.abort(reason)

    return lambda: LLMEngine.load(cfg, building=building.append), interrupt


def _frame(model: ModelConfig) -> tuple[list[int], list[int]] | None:
    """An encoder's special tokens around one text, which truncate_prompt_tokens keeps (InputProcessor)."""
    if not model.encoder or model.tokenizer is None:
        return None
    before, after = model.tokenizer.single_template
    return list(before), list(after)
