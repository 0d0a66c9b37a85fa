"""The streaming offline API (AsyncLLM) on the default model: the same tokens, text and logprobs
as LLM.generate for the same requests, streamed as each output kind says, several requests at
once, abort and a closed iterator freeing their place, and what it refuses."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from neuron import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from neuron.engine.input_processor import RequestError
from neuron.engine.lora import LoRARequest
from neuron.errors import NeuronError

PROMPTS = ["Rivers carry water", "Mountains rise", [5, 6, 7, 8]]
MAX_MODEL_LEN = 256


def requests() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=8, temperature=0.9, seed=3, n=2, ignore_eos=True),
            SamplingParams(max_tokens=6, temperature=0.7, seed=5, n=2, best_of=3,
                           output_kind=RequestOutputKind.FINAL_ONLY)]


@pytest.fixture(scope="module")
def batch_outputs():
    with LLM(max_model_len=MAX_MODEL_LEN) as llm:
        return [llm.generate(PROMPTS, params, use_tqdm=False) for params in requests()]


def run(coroutine):
    return asyncio.run(coroutine)


async def collect(outputs) -> list:
    return [o async for o in outputs]


def shown(out) -> list[tuple]:
    return [(c.index, c.text, c.token_ids, c.finish_reason, c.cumulative_logprob,
             None if c.logprobs is None else [dict(e) for e in c.logprobs]) for c in out.outputs]


def test_every_output_kind_streams_what_the_batch_api_returns(batch_outputs):
    async def main():
        async with AsyncLLM(max_model_len=MAX_MODEL_LEN) as llm:
            async def each(params: SamplingParams) -> list[list]:
                return [await collect(llm.generate(prompt, params)) for prompt in PROMPTS]

            got = []
            for params in requests():
                got.append(await each(params))
                if params.output_kind is not RequestOutputKind.FINAL_ONLY:
                    got.append(await each(replace(params, output_kind=RequestOutputKind.DELTA)))
            return got

    streams = run(main())
    greedy, greedy_delta, seeded, seeded_delta, best = streams
    for want_set, cumulative, delta in ((batch_outputs[0], greedy, greedy_delta),
                                        (batch_outputs[1], seeded, seeded_delta)):
        for want, outs, deltas in zip(want_set, cumulative, delta):
            assert shown(outs[-1]) == shown(want) and outs[-1].finished and not any(o.finished for o in outs[:-1])
            assert outs[-1].prompt_token_ids == want.prompt_token_ids and outs[-1].prompt == want.prompt
            for earlier, later in zip(outs, outs[1:]):  # each output holds the last's and more
                for a, b in zip(earlier.outputs, later.outputs):
                    assert b.token_ids[:len(a.token_ids)] == a.token_ids and b.text.startswith(a.text)
            for c in want.outputs:  # the deltas of a sample join into its whole output
                pieces = [d for o in deltas for d in o.outputs if d.index == c.index]
                assert "".join(d.text for d in pieces) == c.text
                assert [t for d in pieces for t in d.token_ids] == c.token_ids
                assert pieces[-1].finish_reason == c.finish_reason and deltas[-1].finished
    for want, outs in zip(batch_outputs[2], best):  # best_of: the finished output alone, the best two
        assert len(outs) == 1 and shown(outs[0]) == shown(want) and len(outs[0].outputs) == 2


def test_requests_run_together_abort_and_a_closed_iterator_free_their_place(batch_outputs):
    greedy = requests()[0]

    async def main():
        async with AsyncLLM(max_model_len=MAX_MODEL_LEN) as llm:
            async def last(prompt, rid):
                return [o async for o in llm.generate(prompt, greedy, rid)][-1]

            together = await asyncio.gather(*(last(p, f"r{i}") for i, p in enumerate(PROMPTS)))
            long = SamplingParams(max_tokens=MAX_MODEL_LEN - 8, ignore_eos=True)
            seen = []
            async for out in llm.generate("Rivers", long, "stopped"):
                seen.append(out)
                if len(seen) == 1:
                    await llm.abort("stopped")
                    await llm.abort("no such request")  # does nothing
            left_open = len(llm.engine.open_streams)
            stream = llm.generate("Rivers", long, "closed")
            first = await stream.__anext__()
            await stream.aclose()
            await asyncio.sleep(0.2)
            after_close = len(llm.engine.open_streams)
            again = [o async for o in llm.generate("Rivers", greedy, "closed")][-1]  # its id is free again
            return together, seen, left_open, first, after_close, again

    together, seen, left_open, first, after_close, again = run(main())
    assert [shown(o) for o in together] == [shown(w) for w in batch_outputs[0]]
    assert [o.request_id for o in together] == ["r0", "r1", "r2"]
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert len(seen[-1].outputs[0].token_ids) < MAX_MODEL_LEN - 8 and left_open == 0
    assert not first.finished and after_close == 0 and again.finished


def test_what_it_refuses():
    async def main():
        llm = AsyncLLM(max_model_len=MAX_MODEL_LEN)
        with pytest.raises(NeuronError, match="start it first"):
            await anext(llm.generate("x", SamplingParams(max_tokens=1)))
        async with llm:
            long = SamplingParams(max_tokens=50, ignore_eos=True)
            running = llm.generate("Rivers", long, "same")
            await anext(running)
            with pytest.raises(ValueError, match="in use"):
                await anext(llm.generate("Rivers", long, "same"))
            await running.aclose()
            twins = await asyncio.gather(collect(llm.generate("Rivers", long, "twin")),
                                         collect(llm.generate("Rivers", long, "twin")), return_exceptions=True)
            assert sorted(type(t).__name__ for t in twins) == ["ValueError", "list"]  # one id, one request
            with pytest.raises(ValueError, match="FINAL_ONLY"):
                await anext(llm.generate("x", SamplingParams(n=1, best_of=2)))
            with pytest.raises(RequestError):
                await anext(llm.generate([1] * (MAX_MODEL_LEN + 5), SamplingParams(max_tokens=1)))
            with pytest.raises(NeuronError, match="enable_lora"):
                await anext(llm.generate("x", SamplingParams(max_tokens=1),
                                         lora_request=LoRARequest("a", 1, "/nonexistent")))
            assert len(llm.engine.open_streams) == 0
            assert llm.is_running
        assert not llm.is_running

    run(main())
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)
    with pytest.raises(TypeError, match="unsupported arguments: bogus"):
        AsyncLLM(bogus=1)
