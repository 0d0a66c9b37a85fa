"""Prompt text in: refused by its length before any tokenization, then tokenized off the event loop.

A client chooses how much text it sends, so tokenizing it is bounded twice. Text that could never
fit the context is refused by its length alone, at once (Tokenizer.max_chars_per_token says why no
tokenization of it could be short enough). What remains is tokenized in worker threads, a few at a
time, with the GIL released (Tokenizer.encode), so the event loop keeps answering, /health included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio

from neuron.entrypoints.openai.api_errors import APIError
from neuron.utils.openmp import usable_cpus

T = TypeVar("T")

# Threads that tokenize, render templates and decode images at once; more requests wait their turn.
# Half the cores, so a burst of large prompts leaves the engine thread and the event loop room to run.
TOKENIZE_THREADS = max(1, min(4, len(usable_cpus()) // 2))


# Grammars compiled at once. A compile can take a second and much memory, so it has places of its
# own: a burst of grammars never delays tokenizing, and one place keeps the memory of each compile
# measurable (neuron.engine.structured_output).
GRAMMAR_THREADS = 1


@dataclass(slots=True)
class Limiters:
    """The server's places for work a client controls, done in worker threads off the event loop."""

    tokenize: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(TOKENIZE_THREADS))
    grammar: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(GRAMMAR_THREADS))


async def off_loop(limiter: anyio.CapacityLimiter, fn: Callable[..., T], *args) -> T:
    """`fn(*args)` in a worker thread, once one of the limiter's places is free."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)


def check_prompt_chars(engine, num_chars: int, param: str) -> None:
    """Refuse, without tokenizing it, a prompt of `num_chars` characters that must have at least
    max_model_len tokens (the engine refuses those: no room is left to generate)."""
    per_token = engine.tokenizer.max_chars_per_token if engine.tokenizer is not None else None
    if per_token is None or num_chars <= (engine.max_model_len - 1) * per_token:
        return
    at_least = math.ceil(num_chars / per_token)
    raise APIError(400, f"this model's maximum context length is {engine.max_model_len} tokens, but the prompt has "
                        f"{num_chars} characters, which make at least {at_least} tokens", param=param,
                   code="context_length_exceeded")


def check_vocabulary(engine, ids: list[int], param: str) -> None:
    """Refuse token ids outside the model's vocabulary before anything decodes them."""
    bad = next((t for t in ids if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{engine.vocab_size - 1})", param=param)


def check_prompt_ids(engine, prompt, param: str) -> None:
    """Refuse a token-id prompt of max_model_len ids or more before looking at each id."""
    if isinstance(prompt, list) and len(prompt) >= engine.max_model_len and isinstance(prompt[0], int):
        raise APIError(400, f"this model's maximum context length is {engine.max_model_len} tokens, but the prompt has "
                            f"{len(prompt)} tokens (no room to generate)", param=param, code="context_length_exceeded")
