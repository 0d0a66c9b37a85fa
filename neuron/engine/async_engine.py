"""The bridge between asyncio handlers and the engine, which runs on one thread of its own.

Handlers submit with `open` (the engine's thread-safe `add_request`), read their request's
`RequestStream`, and close it (`abort` if it still runs); everything else they ask of the model goes
through `EngineClient`. The engine thread loads the model, then steps while there is work and
sleeps on an event otherwise; after each step it hands the updates to the event loop with
`call_soon_threadsafe`, which queues them on their streams. A request a client abandons therefore leaves the engine at
a step boundary, and nothing but the engine thread ever touches the ranks.

The lifecycle lives in one place, `AsyncEngine.state`: loading -> ready, and from there failed,
recovering (a pool being rebuilt) or shutting_down; `reason` says what a recovery is doing. Shutting
down is two steps: `drain` closes admission and gives in-flight requests a grace period (the engine
keeps stepping), then `stop` ends the engine thread and shuts the ranks down, interrupting a start,
a rebuild or a stuck step rather than waiting for it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Callable

from neuron.config import settings
from neuron.engine.engine_client import EngineClient
from neuron.engine.llm_engine import LLMEngine, Update
from neuron.engine.metrics import Metrics, ModelMetrics
from neuron.engine.pooling import PoolingParams
from neuron.engine.request_stream import RequestStream
from neuron.engine.sampling_params import SamplingParams
from neuron.engine.structured_output import CompiledGrammar
from neuron.errors import NeuronError
from neuron.executor.executor import resource_shortage
from neuron.models.lora import LoraError
from neuron.multimodal.image import ImageInput
from neuron.utils.openmp import release_pool

log = logging.getLogger("neuron.server")

# How long the idle engine thread sleeps before re-checking its state; new work wakes it at once.
_IDLE_WAIT_S = 1.0
_MAX_BACKOFF_S = 30.0  # between rebuilds that keep failing for lack of descriptors or memory
_STOP_STEP_WAIT_S = 2.0  # on stop, a step in progress may end by itself this long before the ranks are interrupted
_STOP_JOIN_S = 5.0  # then the engine thread gets this long to end


class EngineState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    RECOVERING = "recovering"
    FAILED = "failed"
    SHUTTING_DOWN = "shutting_down"


_NOT_READY = {
    EngineState.LOADING: "the model is still loading",
    EngineState.RECOVERING: "the model is recovering from a failure",
    EngineState.FAILED: "the model failed",
    EngineState.SHUTTING_DOWN: "the server is shutting down",
}


class NotReady(NeuronError):
    """The engine cannot take requests in its current state."""

    def __init__(self, state: EngineState, detail: str | None = None):
        super().__init__(_NOT_READY.get(state, f"the model is {state.value}") + (f": {detail}" if detail else ""))
        self.state = state


class Overloaded(NeuronError):
    """Every running and waiting place is taken."""


class AsyncEngine(EngineClient):
    """The engine thread and its lifecycle, requests in and their streams out; what the entrypoints
    may ask of the model besides is `EngineClient`'s."""

    def __init__(
        self,
        factory: Callable[[], LLMEngine],
        *,
        model_name: str,
        max_running: int,
        max_waiting: int,
        metrics: ModelMetrics | None = None,
        interrupt: Callable[[str], None] | None = None,
    ):
        """`interrupt(reason)`, callable from any thread, ends what the ranks are doing at once (a
        start included); without it, `stop` interrupts through the loaded engine's executor.
        `metrics`: this model's series in the server's registry (a registry of its own without)."""
        self._factory = factory
        self._interrupt_hook = interrupt
        self.model_name = model_name
        self.capacity = max_running + max_waiting
        self.max_running = max_running
        # Sequences one request may hold, so that one request never takes every place: all the
        # running slots at most, or half of all places when the waiting queue is larger.
        self.max_per_request = max(max_running, self.capacity // 2)
        self.metrics = metrics or Metrics().for_model(model_name)
        self.engine: LLMEngine | None = None
        self._state = EngineState.LOADING
        self._error: str | None = None
        self._reason: str | None = None  # what a recovery is doing now (rebuilding, waiting to retry)
        self._building = False  # the engine thread is loading or rebuilding the ranks
        self._stop_called = False
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()  # the engine thread should end (admission closes earlier)
        self._streams: dict[str, RequestStream] = {}
        self._listeners: list[Callable[[EngineState], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle ----

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def open_streams(self) -> list[RequestStream]:
        """The streams of the requests admitted and not yet closed, oldest first."""
        return list(self._streams.values())

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def reason(self) -> str | None:
        """While recovering: what the engine is doing about the failure, else None."""
        return self._reason if self._state is EngineState.RECOVERING else None

    def on_state_change(self, listener: Callable[[EngineState], None]) -> None:
        """Call `listener(state)` on the event loop after every transition."""
        self._listeners.append(listener)

    def start(self) -> None:
        """Begin loading in the background; call from the event loop that will read the streams."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="neuron-engine", daemon=True)
        self._thread.start()

    async def drain(self, grace_s: float, hurry: asyncio.Event | None = None, why: str = "the server is shutting down",
                    failure_kind: str = "shutting_down") -> int:
        """Refuse new requests, give the running ones up to `grace_s` (or until `hurry` is set) to
        finish, then cancel the rest with a clean error saying `why` (`failure_kind` tells the
        handlers: `shutting_down`, or `unloaded` for a model a host unloads). Returns how many were
        cancelled."""
        self._set_state(EngineState.SHUTTING_DOWN)
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline and not (hurry is not None and hurry.is_set()):
            await asyncio.sleep(0.05)
        left = len(self._streams)
        if left:
            log.warning("cancelling %d request(s) still running after the %.1f s grace period: %s", left, grace_s,
                        why)
            self._fail_streams(f"{why}; the request was cancelled", failure_kind)
        return left

    def rest_lora(self, name: str) -> None:
        """The ranks drop LoRA adapter `name`'s weights at the next step unless a request uses it
        then; it stays served (`LoraSlots.rest`)."""
        loras = self._loaded().loras
        if loras is not None:
            loras.rest(name)
            self._wake.set()

    async def unload_lora(self, name: str, drain_s: float) -> int:
        """Stop serving LoRA adapter `name`: its new requests are refused at once, those in flight
        get up to `drain_s` to finish and the rest end with an error (failure kind `unloaded`); the
        ranks forget it once none runs. Returns how many were cancelled; LoraError for an unknown name."""
        loras = self._loaded().loras
        if loras is None:
            raise LoraError(f"model `{self.model_name}` serves no LoRA adapters")
        loras.remove(name)
        deadline = time.monotonic() + drain_s
        while any(s.lora == name for s in self._streams.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = [rid for rid, s in self._streams.items() if s.lora == name]
        self._fail_streams(f"LoRA adapter {name!r} was unloaded; the request was cancelled", "unloaded", left)
        self._wake.set()
        return len(left)

    def stop(self, timeout_s: float = _STOP_JOIN_S) -> None:
        """Stop the engine thread and shut the engine down; blocks, so call it off the event loop.
        Only the first call does the work; a later one (the lifespan, then `neuron serve`) waits for it."""
        with self._lock:
            first, self._stop_called = not self._stop_called, True
        if not first:
            self._stopped.wait(_STOP_STEP_WAIT_S + timeout_s)
            return
        try:
            self._stop(timeout_s)
        finally:
            self._stopped.set()

    def _stop(self, timeout_s: float) -> None:
        self._set_state(EngineState.SHUTTING_DOWN)
        self._stopping.set()
        self._wake.set()
        if self._thread is None:
            return
        if not self._building:  # an idle loop ends at once, and a step is given a moment to finish
            self._thread.join(_STOP_STEP_WAIT_S)
        if self._thread.is_alive():
            self._interrupt("the server is shutting down")
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("engine thread still busy %.0f s after it was interrupted; leaving it", timeout_s)
        self._call_in_loop(self._fail_streams, "the server is shutting down; the request was cancelled",
                           "shutting_down")

    def _interrupt(self, reason: str) -> None:
        """End a start, a rebuild or a step that would otherwise keep the engine thread past the stop."""
        executor = getattr(self.engine, "executor", None)
        hook = self._interrupt_hook or getattr(executor, "abort", None)
        if hook is not None:
            log.info("interrupting the ranks: %s", reason)
            hook(reason)

    def _set_state(self, state: EngineState, error: str | None = None) -> None:
        with self._lock:
            if self._state is state or self._state is EngineState.SHUTTING_DOWN:
                return
            self._state, self._error = state, error
        level = logging.ERROR if state is EngineState.FAILED else logging.INFO
        log.log(level, "engine %s%s", state.value, f": {error!r}" if error else "")
        self.metrics.state.state(state.value)
        for listener in self._listeners:
            self._call_in_loop(listener, state)

    def _call_in_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    # ---- requests (event-loop thread) ----

    def open(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
             images: list[ImageInput] | None = None, count_prompt: bool = True,
             grammar: CompiledGrammar | None = None, cache_salt: str | None = None,
             lora: str | None = None, types_from: int | None = None) -> RequestStream:
        """Submit a request (its image placeholders already expanded, its grammar compiled if it has
        one), or with PoolingParams an embedding request, whose one update carries the vector;
        raises NotReady, Overloaded or the engine's RequestError. `count_prompt`: False for
        the further samples of a prompt (n, best_of), whose tokens the prompt-token counter already has.
        `cache_salt`, `lora`, `types_from`: see LLMEngine.add_request."""
        if self._state is not EngineState.READY:
            raise NotReady(self._state, self._error)
        if len(self._streams) >= self.capacity:
            raise Overloaded(f"all {self.capacity} running and waiting places are taken")
        self.engine.add_request(request_id, prompt_token_ids, params, images=images, grammar=grammar,
                                cache_salt=cache_salt, lora=lora, types_from=types_from)
        stream = RequestStream(self.metrics, request_id, len(prompt_token_ids), self._close)
        stream.lora = lora
        self._streams[request_id] = stream
        if count_prompt:
            self.metrics.prompt_tokens.inc(len(prompt_token_ids))
        self._wake.set()
        return stream

    def _close(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        if not stream.finished:
            log.info("request %s aborted by the client after %d tokens", stream.request_id, stream.num_output_tokens)
            self.metrics.finished_with("abort")
            if self.engine is not None:
                self.engine.abort(stream.request_id)
                self._wake.set()

    def _deliver(self, updates: list[Update], failure_kind: str | None = None) -> None:
        for update in updates:
            stream = self._streams.get(update.request_id)
            if stream is None:  # closed by its client; the engine has dropped it or will
                continue
            if update.finished:
                del self._streams[update.request_id]
                kind = failure_kind or update.failure_kind  # a rank's failure, else the request's own
                if kind is not None and update.finish_reason == "error":
                    stream.failure_kind = kind
            stream.put(update)
            if update.finished:
                self._finished(stream, update)

    def _finished(self, stream: RequestStream, update: Update) -> None:
        now = time.monotonic()
        self.metrics.finished_with(stream.finish_reason)
        self.metrics.e2e.observe(now - stream.arrival)
        ttft = (stream.first_token_at or now) - stream.arrival
        log.info("request %s %s: %d prompt + %d output tokens, ttft %.1f ms, total %.1f ms%s",
                 stream.request_id, stream.finish_reason, stream.num_prompt_tokens, stream.num_output_tokens,
                 ttft * 1e3, (now - stream.arrival) * 1e3, f", error: {update.error!r}" if update.error else "")

    def _fail_streams(self, message: str, failure_kind: str | None = None, only: list[str] | None = None) -> None:
        """End every open request (or those of `only`) with an error, and abort it in case the engine
        still runs it."""
        for rid in list(self._streams) if only is None else only:
            if self.engine is not None:
                self.engine.abort(rid)
            self._deliver([Update(rid, [], "", None, True, "error", error=message)], failure_kind)

    # ---- the engine thread ----

    def _run(self) -> None:
        self._building = True
        try:
            engine = self._factory()
        except Exception as exc:
            if self._stopping.is_set():
                log.info("loading stopped: the server is shutting down")
            elif not isinstance(exc, NeuronError):  # ours carry a message to act on; others need the trace
                log.exception("engine failed to load")
            self._set_state(EngineState.FAILED, f"{type(exc).__name__}: {exc}")
            return
        finally:
            self._building = False
        self.engine = engine
        engine.on_failure(lambda reason: self._wake.set())  # a rank died: act now, not at the next step
        try:
            self._set_state(EngineState.READY)
            self._loop_forever(engine)
        except Exception as exc:
            log.exception("engine loop failed")
            message = f"{type(exc).__name__}: {exc}"
            self._set_state(EngineState.FAILED, message)
            self._call_in_loop(self._fail_streams, message)
        finally:
            engine.shutdown()

    def _loop_forever(self, engine: LLMEngine) -> None:
        stepped = False  # since the engine was last idle
        while not self._stopping.is_set():
            if engine.failure is not None:
                if not self._recover(engine):
                    return
                continue
            if not engine.has_unfinished():
                if stepped:
                    # this thread's OpenMP pool goes while it idles (the next step makes it again): a host's
                    # idle models then hold no pool threads, whose number beyond the CPUs would put every
                    # model's parallel regions on libgomp's sleeping path (neuron/utils/openmp.py)
                    release_pool()
                    stepped = False
                self.metrics.engine_load(engine.num_running(), engine.num_waiting(), engine.kv_slot_usage())
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            stepped = True
            try:
                updates = engine.step()
            except Exception as exc:
                self._contain(engine, exc)
                continue
            if updates:
                self._call_in_loop(self._deliver, updates)
            self.metrics.engine_load(engine.num_running(), engine.num_waiting(), engine.kv_slot_usage())
            self.metrics.kv_cache(engine.kv_cache_usage(), *engine.prefix_cache_counts())
            if engine.spec is not None:
                counts = engine.spec.counts
                self.metrics.speculative(counts.proposed, counts.accepted, counts.steps)

    def _contain(self, engine: LLMEngine, exc: Exception) -> None:
        """A bug on the leader's side of a step (scheduling, sampling, detokenising) fails the requests
        in flight, not the server: rank failures never get here (the engine turns them into
        `failure`), so the ranks finished the step together and stay in step. Every open stream
        ends, including any whose final update the failed step had already made and then lost."""
        log.exception("engine step failed; failing the requests in flight")
        message = f"internal error: {type(exc).__name__}: {exc}"
        self._call_in_loop(self._deliver, engine.fail_in_flight(message), "internal_error")
        self._call_in_loop(self._fail_streams, message, "internal_error")

    def _recover(self, engine: LLMEngine) -> bool:
        """Fail what is in flight, then rebuild the ranks with backoff; after the last failed attempt
        the state is `failed` and stays so (no restart loop). A rebuild that failed for lack of
        descriptors or memory is not counted: it is retried until the resource is back. Returns
        whether the engine is ready."""
        reason = engine.failure
        self._reason = "failing the requests in flight"
        self._set_state(EngineState.RECOVERING, reason)
        updates = engine.fail_in_flight(f"the model failed and is recovering: {reason}")
        if updates:
            self._call_in_loop(self._deliver, updates)
        if self._state is EngineState.SHUTTING_DOWN:  # no point rebuilding ranks about to be shut down
            self._call_in_loop(self._fail_streams, f"the model failed while the server shuts down: {reason}")
            return False
        self.metrics.recoveries.inc()
        attempts, backoff = settings().recovery_attempts, settings().recovery_backoff_s
        counted = tries = 0
        while True:
            tries += 1
            self._reason = f"rebuilding the ranks (try {tries})"
            problem = self._rebuild(engine, tries)
            if problem is None:
                self._set_state(EngineState.READY)
                return True
            error, shortage = problem
            counted += shortage is None
            if counted >= attempts:
                break
            wait = min(_MAX_BACKOFF_S, backoff * 2 ** (tries - 1))
            why = f"short of a resource ({shortage})" if shortage else error
            self._reason = f"rebuild {tries} failed, {why}; retrying in {wait:g} s"
            if self._shutdown_requested(wait):
                return False
        message = f"recovery failed after {attempts} attempts; last failure: {reason}"
        self._set_state(EngineState.FAILED, message)
        self._call_in_loop(self._fail_streams, message)
        return False

    def _rebuild(self, engine: LLMEngine, tries: int) -> tuple[str, str | None] | None:
        """One rebuild; None when it worked, else what went wrong and the resource that ran out, if
        that was why (text only: the exception would keep the failed attempt's objects alive)."""
        t0 = time.monotonic()
        self._building = True
        try:
            engine.restart()
        except Exception as exc:
            shortage = resource_shortage(exc)
            log.error("rebuild %d failed%s: %r", tries, f", short of a resource ({shortage})" if shortage else "", str(exc))
            return f"{type(exc).__name__}: {exc}", shortage
        finally:
            self._building = False
        log.info("recovered in %.0f ms (try %d)", (time.monotonic() - t0) * 1e3, tries)
        return None

    def _shutdown_requested(self, wait_s: float) -> bool:
        """Sleep for the backoff, waking early for a shutdown."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self._state is EngineState.SHUTTING_DOWN:
                return True
            time.sleep(min(0.1, deadline - time.monotonic()))
        return self._state is EngineState.SHUTTING_DOWN
