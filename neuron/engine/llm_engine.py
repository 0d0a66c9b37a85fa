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
from pathlib import Path

import torch

from neuron.config import MAX_MODEL_LEN_CAP, parse_bytes
from neuron.engine import prompt_logprobs
from neuron.engine.block_manager import BlockManager, salt_key
from neuron.engine.engine_config import EngineConfig, default_device
from neuron.engine.input_processor import InputProcessor, RequestError, check_cache_salt
from neuron.engine.loading import load_within
from neuron.engine.output_processor import OutputProcessor, Update
from neuron.engine.sampling import SampleFailure, SequenceSampler, TokenBitmask, sample
from neuron.engine.sampling_params import SamplingParams
from neuron.engine.scheduler import Scheduled, Scheduler
from neuron.engine.sequence import Sequence, Status
from neuron.engine.speculative import Acceptance, SpeculativeConfig, make_proposer
from neuron.engine.structured_output import CompiledGrammar, StructuredOutput
from neuron.engine.tokenizer import Tokenizer
from neuron.errors import ConfigError, WorkerError
from neuron.executor.executor import Executor, ExecutorConfig
from neuron.layers import cpu_attention
from neuron.layers.kernels import Kernels
from neuron.models import (
    MULTIMODAL_MODEL_TYPES,
    check_tp,
    context_length,
    load_config,
    supports_prefix_caching,
    text_config,
)
from neuron.models.gguf import find_gguf, open_file
from neuron.models.loader import read_generation_config, resolve_model_path
from neuron.models.quant_formats import checkpoint_quantization
from neuron.multimodal.image import ImageError, ImageInput, VisionSpec, image_spans
from neuron.step import SeqStep, StepImage
from neuron.utils.device import to_device

log = logging.getLogger("neuron.engine.llm_engine")


class LLMEngine:
    def __init__(self, cfg: EngineConfig, worker_cmd=None, phases: Callable[[str], None] | None = None):
        """`phases(what)` hears what the load is doing (loading.Phases, for its deadline's message)."""
        self.cfg = cfg
        self._shut_down = threading.Event()
        self.phases = phases or (lambda what: None)
        self.phases("finding the model")
        if cfg.model is None:
            from neuron.utils.default_checkpoint import default_model_dir

            self.model_dir = default_model_dir()
        else:
            self.model_dir = resolve_model_path(cfg.model, cfg.hf_cache_dir)
        self.model_name = cfg.served_model_name or (cfg.model or "neuron-default")
        self.phases(f"reading the config of {self.model_dir}")
        self.config = load_config(self.model_dir, cfg.hf_overrides)  # refused before any worker starts
        check_tp(self.config, cfg.tp)
        self.gguf = find_gguf(self.model_dir)
        self.device = cfg.device or default_device()
        self.quantization = cfg.quantization or _stored_quantization(self.config, self.gguf)
        self.max_model_len = self._max_model_len()
        self.vocab_size = _vocab_size(self.config)
        self.phases("building the tokenizer")
        self.tokenizer, tokenizer_dir = self._tokenizer()
        self.generation_config = read_generation_config(tokenizer_dir) if tokenizer_dir else {}
        self.eos_token_ids = self._eos_ids()
        self.vision = self._vision_spec()
        chunk = cfg.prefill_chunk_tokens
        step_tokens = cfg.max_num_batched_tokens or max(chunk, cfg.max_num_seqs)
        self.speculative = self._speculative_config()
        self.spec_counts = [0, 0, 0]  # tokens proposed, proposed tokens accepted, speculative sequence-steps
        spec = self.speculative
        self.proposer = self._proposer(step_tokens) if spec else None
        self.scheduler = Scheduler(cfg.max_num_seqs, step_tokens, chunk, proposer=self.proposer,
                                   spec_length=self._spec_length,
                                   speculate_up_to=spec.disable_by_batch_size if spec else 0,
                                   max_image_bytes=lambda: self.executor.max_image_bytes)
        executor_cfg = ExecutorConfig(self.model_dir, max_model_len=self.max_model_len, tp=cfg.tp, hosts=cfg.hosts,
                                      worker_launcher=cfg.worker_launcher, cluster_address=cfg.cluster_address,
                                      cluster_interface=cfg.cluster_interface, cluster_port=cfg.cluster_port,
                                      device=self.device, name=self.model_name,
                                      dtype=cfg.dtype, quantization=cfg.quantization, max_slots=cfg.max_num_seqs,
                                      max_num_batched_tokens=max(step_tokens, cfg.max_num_seqs), **self._kv_settings(),
                                      load_timeout_s=cfg.load_timeout_s,
                                      verify_tokens=1 + spec.num_speculative_tokens if spec else 0,
                                      verify_batch=spec.disable_by_batch_size if spec else 0)
        kwargs = {"worker_cmd": worker_cmd} if worker_cmd else {}
        self.phases("reading the weight index and planning memory")
        self.executor = Executor(executor_cfg, model_config=self.config, **kwargs)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.structured = (StructuredOutput(self.tokenizer, self.vocab_size, self.eos_token_ids)
                           if self.tokenizer is not None else None)
        self.inputs = InputProcessor(self.max_model_len, self.vocab_size, self.eos_token_ids, self.vision, self.structured,
                                     lambda: self.executor.max_image_bytes, self.executor.devices[0], cfg.dtype,
                                     self.executor.devices.count(self.executor.devices[0]))

    def start(self) -> "LLMEngine":
        self.executor.start(self.phases)
        self._new_blocks()
        return self

    @classmethod
    def load(cls, cfg: EngineConfig, worker_cmd=None,
             building: Callable[["LLMEngine"], None] | None = None) -> "LLMEngine":
        """A started engine, built and started within load_timeout_s (loading.LoadTimeout naming the
        phase otherwise). `building(engine)` hears of the engine before it starts (to interrupt it)."""
        made: list[LLMEngine] = []

        def build(phases) -> LLMEngine:
            engine = cls(cfg, worker_cmd, phases)
            made.append(engine)
            if building is not None:
                building(engine)
            return engine.start()

        def interrupt(reason: str) -> None:
            if made:
                made[0].executor.abort(reason)

        return load_within(build, cfg.load_timeout_s, interrupt, close=lambda engine: engine.shutdown(),
                           hold=lambda engine: engine._shut_down.wait())

    def _proposer(self, step_tokens: int):
        cfg = self.cfg
        return make_proposer(self.speculative, target_config=self.config, device=self.device, dtype=cfg.dtype,
                             max_model_len=self.max_model_len, max_slots=cfg.max_num_seqs, block_size=cfg.block_size,
                             step_tokens=step_tokens, prefill_chunk=cfg.prefill_chunk_tokens,
                             hf_cache_dir=cfg.hf_cache_dir)

    def _kv_settings(self) -> dict:
        cfg = self.cfg
        kv_bytes = 0 if cfg.kv_cache_memory is None else parse_bytes(cfg.kv_cache_memory, "kv_cache_memory")
        if cfg.enable_prefix_caching and not supports_prefix_caching(self.config):
            raise ConfigError(f"prefix caching is not available for model_type {self.config.get('model_type')!r}: "
                              "its recurrent layers keep state that cannot be shared between sequences")
        return dict(block_size=cfg.block_size, kv_cache_bytes=kv_bytes,
                    gpu_memory_utilization=cfg.gpu_memory_utilization)

    def _new_blocks(self) -> None:
        """A block manager over the pool the ranks just allocated (empty: a new pool holds nothing)."""
        caching = self.cfg.enable_prefix_caching is not False and supports_prefix_caching(self.config)
        self.scheduler.use_blocks(BlockManager(self.executor.num_kv_blocks, self.executor.cfg.block_size, caching))
        if self.proposer is not None:
            # a draft's pool mirrors the target's; its cost is priced against a target rank's weights
            self.proposer.start(self.executor.num_kv_blocks, max(self.executor.weight_bytes))

    def _speculative_config(self) -> SpeculativeConfig | None:
        spec = SpeculativeConfig.parse(self.cfg.speculative_config)
        if spec is not None and not supports_prefix_caching(self.config):
            raise ConfigError(f"speculative decoding is not available for model_type {self.config.get('model_type')!r}: "
                              "its recurrent layers' state cannot be rolled back past rejected tokens")
        return spec

    def _spec_length(self, seq: Sequence) -> int:
        """How many tokens a decoding sequence may have proposed: as many as its acceptance earns,
        the room left under max_tokens and the model length allows."""
        if seq.images or seq.params.prompt_logprobs is not None:
            return 0
        if seq.acceptance is None:
            seq.acceptance = Acceptance()
        return min(seq.acceptance.length(self.speculative.num_speculative_tokens, self.proposer.cost),
                   seq.max_tokens - len(seq.output_token_ids) - 1, self.max_model_len - seq.num_tokens)

    def _tokenizer(self) -> tuple[Tokenizer | None, Path | None]:
        """The tokenizer (--tokenizer's, else the checkpoint's own or the GGUF file's; None without
        one) and the folder whose generation_config.json applies."""
        source = self.cfg.tokenizer
        folder = resolve_model_path(source, self.cfg.hf_cache_dir) if source else None
        if folder is not None and not folder.is_dir():
            raise ConfigError(f"--tokenizer {source}: pass a folder (or cached repo) holding tokenizer.json")
        if folder is None and self.gguf is not None:
            return Tokenizer.from_gguf(self.gguf), None
        folder = folder or self.model_dir
        return (Tokenizer.from_dir(folder) if (folder / "tokenizer.json").is_file() else None), folder

    def _vision_spec(self) -> VisionSpec | None:
        """How the checkpoint takes images; None when it has no vision tower (config or weights)."""
        if self.config.get("model_type") not in MULTIMODAL_MODEL_TYPES:
            return None
        spec = VisionSpec.from_checkpoint(self.config, self.model_dir)
        if spec is None:
            return None
        from neuron.models.loader import CheckpointReader, safetensors_files

        with CheckpointReader(safetensors_files(self.model_dir)) as reader:
            has_tower = reader.has("model.visual.patch_embed.proj.weight")
        return spec if has_tower else None

    def _max_model_len(self) -> int:
        native = context_length(self.config)
        wanted = self.cfg.max_model_len
        if wanted is None:
            return min(native, MAX_MODEL_LEN_CAP)
        if not 1 < wanted <= native:
            raise ConfigError(f"max_model_len must be in 2..{native} (the model's max_position_embeddings, stretched "
                              f"by its rope scaling if it has one), got {wanted}")
        return wanted

    def _eos_ids(self) -> list[int]:
        ids = self.generation_config.get(
            "eos_token_id", self.config.get("eos_token_id", text_config(self.config).get("eos_token_id"))
        )
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))

    def kernels(self) -> dict[str, str]:
        """What runs each fused piece: on CUDA `triton` or `reference: <why>` (the self-check's
        verdict, the same on every rank); on CPU whether the C++ attention kernel could be built."""
        if self.executor.devices[0].startswith("cuda"):
            return Kernels.from_settings(self.executor.failed_kernels).verdict()
        built = cpu_attention.library() is not None
        return {"paged_attention": "cpu" if built else "reference: the CPU kernel could not be built here"}

    def default_sampling(self) -> dict:
        """Sampling defaults from generation_config.json, applied where a request is silent."""
        g = self.generation_config
        return {k: g[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty") if k in g}

    # ---- requests (any thread) ----

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 images: list[ImageInput] | None = None) -> int:
        """Refuse a request that cannot run (RequestError); its max_tokens clamped to the context."""
        return self.inputs.validate(prompt_token_ids, params, images)

    def check_images(self, uris: list, placeholders: int | None = None) -> list[ImageInput]:
        return self.inputs.check_images(uris, placeholders)

    def expand_images(self, prompt_token_ids: list[int], images: list[ImageInput]) -> list[int]:
        return self.inputs.expand_images(prompt_token_ids, images)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    images: list[ImageInput] | None = None, grammar: CompiledGrammar | None = None,
                    cache_salt: str | None = None) -> None:
        """Queue a request. With images, the prompt's placeholders are already expanded
        (`expand_images`) and must hold each image's run of tokens, in order. `grammar`: the
        params' structured output, compiled already (else it is compiled here). `cache_salt`: the
        request shares cached prefix blocks only with requests of the same salt (None: unsalted)."""
        check_cache_salt(cache_salt)
        max_tokens, matcher = self.inputs.admit(prompt_token_ids, params, images, grammar)
        sampler = SequenceSampler(params, prompt_token_ids, self.vocab_size, self.executor.devices[0])
        seq = Sequence(request_id, list(prompt_token_ids), params, sampler, max_tokens, images=list(images or []),
                       grammar=matcher, cache_salt=salt_key(cache_salt))
        self._inbox.put(("add", seq))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    # ---- the loop (engine thread only) ----

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

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
                self._admit(item)
            elif (seq := self.outputs.sequence(item)) is not None:
                self.scheduler.finish(seq, "abort")
                updates.append(self.outputs.end(seq))

    def _admit(self, seq: Sequence) -> None:
        self.outputs.add(seq)
        self.scheduler.add(seq)

    def step(self) -> list[Update]:
        """Admit and abort what arrived, then schedule, execute, update the scheduler, sample and
        report. A rank failure ends every request in flight; any other fault ends only the
        requests it touched."""
        updates = self._drain_inbox()
        batch = self.scheduler.schedule()
        if not batch:
            return updates
        logits, ran = self._execute(batch, updates)
        if not ran:
            return updates
        rows, scored = self.scheduler.update_from_output(ran)
        updates += [self.outputs.end(seq) for seq in scored]  # prompt scored, nothing to generate
        if not rows:
            return updates
        ready = [ran[i] for i in rows]
        if any(s.proposal for s in ran):
            starts = [0]
            for s in ran:
                starts.append(starts[-1] + s.logits)
            flat = [r for i in rows for r in range(starts[i], starts[i + 1])]
            return updates + self._sample_speculative(ready, _rows(logits, flat))
        return updates + self._sample(ready, _rows(logits, rows))

    def _execute(self, batch: list[Scheduled], updates: list[Update]) -> tuple[torch.Tensor | None, list[Scheduled]]:
        """Run the step's forward; the logits and the scheduled sequences they belong to, in row
        order. A failed forward's requests end (into `updates`)."""
        try:
            return self._forward(batch), batch
        except Exception as exc:  # noqa: BLE001 - contained: a rank failure or only this step's requests
            if self.failure is not None:  # the ranks are out of step: nothing in flight can go on
                updates += self.fail_in_flight(str(exc))
            else:
                updates += self._forward_failed(batch, exc)
            return None, []

    def _forward(self, part: list[Scheduled]) -> torch.Tensor:
        steps = self._steps(part)
        if all(st.prompt_logprobs is None for st in steps):
            return self.executor.step(steps)
        result = self.executor.run_step(steps)
        prompt_logprobs.accumulate(part, result)
        return result.logits

    def _steps(self, part: list[Scheduled]) -> list[SeqStep]:
        return [SeqStep(s.seq.slot, s.token_ids, s.offset, s.new_blocks, s.fresh, prompt_logprobs.wanted(s), s.logits,
                        self._step_images(s)) for s in part]

    def _step_images(self, s: Scheduled) -> list[StepImage]:
        """A sequence's images, on its first step in its slot: each one's URI and where its
        placeholders start in the prompt (checked against its images when the request came in)."""
        if not (s.fresh and s.seq.images):
            return []
        images = s.seq.images
        spans = image_spans(s.seq.prompt_token_ids, self.vision.image_token_id, [i.num_tokens for i in images])
        return [StepImage(image.uri, start) for image, (start, _) in zip(images, spans)]

    def _forward_failed(self, part: list[Scheduled], exc: Exception) -> list[Update]:
        """A forward that every rank refused or failed alike (a request the ranks reject, a bug on the
        leader's side) leaves the ranks in step: only its own sequences end. Nothing of it was marked
        computed, so no block it wrote enters the prefix cache."""
        seqs = [s.seq for s in part]
        if isinstance(exc, WorkerError):  # the ranks' own message says what was wrong
            return self._fail(seqs, str(exc))
        return self._fail(seqs, _internal("running the model", exc), "internal_error", exc)

    def _sample(self, ready: list[Scheduled], logits: torch.Tensor) -> list[Update]:
        """Sample every ready sequence and advance it; a fault in one sequence ends it alone."""
        try:
            result = sample(logits, [s.seq.sampler for s in ready], self.eos_token_ids, self._allowed(ready))
        except Exception as exc:  # noqa: BLE001 - contained: each row is retried alone
            # Not a row the sampler could name: find it by sampling each row alone. A seeded row
            # drawn before the fault may draw again, so its token can differ from a clean step's.
            log.warning("sampling a batch of %d failed (%s: %s); sampling each sequence alone",
                        len(ready), type(exc).__name__, exc)
            return [self._sample_alone(s, logits[i : i + 1]) for i, s in enumerate(ready)]
        return [self._advance_or_fail(s, token, lp, result.failed.get(i))
                for i, (s, token, lp) in enumerate(zip(ready, result.token_ids, result.logprobs))]

    def _sample_speculative(self, ready: list[Scheduled], logits: torch.Tensor) -> list[Update]:
        """Sample each sequence's positions in order, as plain decode steps would, while the token
        sampled equals the one proposed (speculative.py); the first that differs is kept, the rest
        of the proposal dropped. `logits`: each sequence's `logits` rows, in order."""
        starts = [0]
        for s in ready:
            starts.append(starts[-1] + s.logits)
        updates: list[Update] = []
        accepted = [0] * len(ready)
        active, position = list(range(len(ready))), 0
        while active:
            part = [ready[i] for i in active]
            updates += self._sample(part, _rows(logits, [starts[i] + position for i in active]))
            still = []
            for i in active:
                s = ready[i]
                if s.seq.status is Status.RUNNING and position < len(s.proposal) \
                        and s.seq.output_token_ids[-1] == s.proposal[position]:
                    accepted[i] += 1
                    still.append(i)
            active, position = still, position + 1
        for s, n in zip(ready, accepted):
            if not s.proposal:
                continue
            s.seq.acceptance.record(len(s.proposal), n)
            self.spec_counts[0] += len(s.proposal)
            self.spec_counts[1] += n
            self.spec_counts[2] += 1
            if s.seq.status is Status.RUNNING:
                self.scheduler.accept_proposed(s.seq, n)
        return updates

    def _sample_alone(self, s: Scheduled, row: torch.Tensor) -> Update:
        try:
            result = sample(row, [s.seq.sampler], self.eos_token_ids, self._allowed([s]))
        except Exception as exc:  # noqa: BLE001 - contained: this sequence alone ends
            return self._fail([s.seq], _internal("sampling", exc), "internal_error", exc)[0]
        return self._advance_or_fail(s, result.token_ids[0], result.logprobs[0], result.failed.get(0))

    def _allowed(self, ready: list[Scheduled]) -> TokenBitmask | None:
        """The grammar masks of the sequences with structured output, one call for the batch."""
        if self.structured is None:
            return None
        return self.structured.allowed_tokens([s.seq.grammar for s in ready])

    def _advance_or_fail(self, s: Scheduled, token: int, logprobs: dict[int, float] | None,
                         failure: SampleFailure | None) -> Update:
        if failure is not None:
            kind = "invalid_request" if failure.by_request else "internal_error"
            return self._fail([s.seq], failure.message, kind)[0]
        try:
            return self._advance(s, token, logprobs)
        except Exception as exc:  # noqa: BLE001 - contained: this sequence alone ends
            return self._fail([s.seq], _internal("processing the output", exc), "internal_error", exc)[0]

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

    def _advance(self, s: Scheduled, token: int, logprobs: dict[int, float] | None) -> Update:
        seq = s.seq
        if not self.scheduler.advance(seq, token):  # a grammar past its limits, mid-way
            return self._fail([seq], f"structured output failed: {seq.grammar.error}", "invalid_request")[0]
        update = self.outputs.process(seq, token, logprobs)
        if update.finished:
            self.scheduler.finish(seq, update.finish_reason, update.stop_reason)
        return update

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
        if self.proposer is not None:
            self.proposer.close()
        self._shut_down.set()


def _vocab_size(config: dict) -> int:
    t = text_config(config)
    if not isinstance(t.get("vocab_size"), int) or t["vocab_size"] < 1:
        raise ConfigError(f"config.json needs vocab_size as a positive integer, got {t.get('vocab_size')!r}")
    return t["vocab_size"]


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """These rows of `logits`. The index travels without blocking: indexing with a list would copy
    it from pageable memory, and the host would wait for the step's forward."""
    if len(rows) == logits.shape[0]:
        return logits
    return logits.index_select(0, to_device(rows, logits.device, torch.long))


def _internal(doing: str, exc: Exception) -> str:
    return f"internal error while {doing}: {type(exc).__name__}: {exc}"


def _stored_quantization(config: dict, gguf: Path | None) -> str | None:
    """How a checkpoint stores its weights when quantized: a GGUF file's types, or the method."""
    if gguf is not None:
        return f"gguf: {open_file(gguf).types()}"
    spec = checkpoint_quantization(config)
    if spec is None:
        return None
    bits = f" {spec['bits']}-bit" if "bits" in spec else ""
    return f"{spec['method']}{bits}"


def encode_prompt(engine: LLMEngine, prompt: str) -> list[int]:
    """A text prompt's ids with the special tokens the tokenizer's post-processor adds (Llama's and
    Mistral's BOS; nothing for Qwen's), as transformers and vLLM encode a completion's prompt. A
    chat's template writes its own BOS, so rendered chats are encoded without them."""
    if engine.tokenizer is None:
        raise RequestError("this checkpoint has no tokenizer.json: send token ids instead of text", param="prompt")
    return engine.tokenizer.encode(prompt, add_special_tokens=True)


__all__ = ["EngineConfig", "ImageError", "LLMEngine", "RequestError", "Update", "encode_prompt"]
