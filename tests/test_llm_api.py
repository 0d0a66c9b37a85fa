"""The offline API as users meet it: text prompts, token prompts, stop rules, lifecycle."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from caches import fresh_cache
from server_harness import gone, wait_until

from neuron import LLM, SamplingParams
from neuron.engine.llm_engine import RequestError


@pytest.fixture(scope="module")
def tp2_llm(tmp_path_factory):
    """`LLM()` on the default model at tp=2, with a cache of its own for the module's time."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEURON_CACHE_DIR", str(fresh_cache(tmp_path_factory.mktemp("neuron-cache"))))
        with LLM(tensor_parallel_size=2, device="cpu", max_model_len=256) as llm:
            yield llm


def test_text_and_token_prompts_in_one_batch(tp2_llm):
    tok = tp2_llm.get_tokenizer()
    ids = tok.encode("The quick brown fox")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    a, b = tp2_llm.generate(["The quick brown fox", {"prompt_token_ids": ids}], params)
    assert a.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].text == tok.decode(a.outputs[0].token_ids)
    assert a.outputs[0].finish_reason == "length" and len(a.outputs[0].token_ids) == 12


def test_seed_reproducible(tp2_llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)
    first = tp2_llm.generate("Hello", params)[0].outputs[0].token_ids
    again = tp2_llm.generate(["Hello", "other prompt"], params)[0].outputs[0].token_ids
    assert first == again


def test_stop_token_ids_and_max_tokens(tp2_llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref = tp2_llm.generate("Once upon", greedy)[0].outputs[0].token_ids
    stop_at = ref[3]
    cut = tp2_llm.generate("Once upon", SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_at],
                                                   ignore_eos=True))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_at
    assert cut.token_ids == ref[: ref.index(stop_at) + 1]


def test_a_call_without_sampling_params_samples_with_generation_config(tp2_llm, monkeypatch):
    """As vLLM's LLM: the checkpoint's generation_config.json (the default model's: temperature 0.6,
    top_k 20, top_p 0.95) over SamplingParams' own defaults."""
    defaults = tp2_llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.max_tokens) == (0.6, 20, 0.95, 16)
    seen = []
    add = tp2_llm.engine.add_request
    monkeypatch.setattr(tp2_llm.engine, "add_request", lambda *a, **kw: seen.append(a[2]) or add(*a, **kw))
    tp2_llm.generate("Hello")
    assert [(p.temperature, p.top_k, p.top_p) for p in seen] == [(0.6, 20, 0.95)]


def test_stop_string_ends_text_before_it(tp2_llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    full = tp2_llm.generate("In the", greedy)[0].outputs[0].text
    stop = full[5:8]
    assert stop
    out = tp2_llm.generate("In the", SamplingParams(temperature=0.0, max_tokens=16, stop=[stop], ignore_eos=True))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[: full.index(stop)]


def test_logprobs_shape(tp2_llm):
    out = tp2_llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for token, lp in zip(c.token_ids, c.logprobs):
        assert token in lp and len(lp) == 3  # greedy: the sampled token is one of the top 3
        assert lp[token] == max(lp.values())  # greedy picks the most likely
    assert c.cumulative_logprob == pytest.approx(sum(lp[t] for lp, t in zip(c.logprobs, c.token_ids)))


def test_context_is_clamped_and_overlong_prompt_rejected(tp2_llm):
    out = tp2_llm.generate({"prompt_token_ids": [5] * 250}, SamplingParams(temperature=0.0, max_tokens=100,
                                                                        ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"
    with pytest.raises(RequestError) as err:
        tp2_llm.generate({"prompt_token_ids": [5] * 256}, SamplingParams(max_tokens=1))
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(RequestError, match="outside the vocabulary"):
        tp2_llm.generate({"prompt_token_ids": [10**7]}, SamplingParams(max_tokens=1))


def test_chat(tp2_llm):
    out = tp2_llm.chat([{"role": "user", "content": "Hello there"}], SamplingParams(temperature=0.0, max_tokens=5))
    assert out[0].prompt == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tp2_llm):
    """vLLM's SamplingParams.truncate_prompt_tokens: a prompt longer than the context runs on its
    last tokens, as those alone would; out of range is refused before anything is queued."""
    ids = [(7 * i + 11) % 500 + 10 for i in range(300)]  # past the LLM's 256
    greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    cut, alone = tp2_llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": ids[-50:]}],
                                  [SamplingParams(truncate_prompt_tokens=50, **greedy), SamplingParams(**greedy)])
    assert cut.prompt_token_ids == ids[-50:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    short = tp2_llm.generate({"prompt_token_ids": ids[:10]}, SamplingParams(truncate_prompt_tokens=50, **greedy))
    assert short[0].prompt_token_ids == ids[:10]
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1, an integer >= 1, or null"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(RequestError, match=r"greater than this model's context \(256 tokens\)"):
        tp2_llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=257))


def test_beam_search_takes_text_and_returns_vllms_text(tp2_llm):
    """A text prompt's beams: `text` is the prompt's and the beam's, as vLLM's offline beam search
    gives it; `tokens` the ids it decodes."""
    from neuron import BeamSearchParams

    [out] = tp2_llm.beam_search(["The river"], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    tok = tp2_llm.get_tokenizer()
    assert len(out.sequences) == 2 and out.sequences[0].cum_logprob >= out.sequences[1].cum_logprob
    for beam in out.sequences:
        assert beam.text == tok.decode(beam.tokens) and beam.text.startswith("The river")


def test_llm_takes_vllms_seed_and_engine_arguments():
    """LLM(seed=...) makes a script's unseeded draws the same from run to run, as vLLM's does;
    trust_remote_code, served_model_name and max_num_batched_tokens are taken too."""
    drawn = []
    for _ in range(2):
        with LLM(device="cpu", max_model_len=128, seed=7, trust_remote_code=True, served_model_name="mine",
                 max_num_batched_tokens=256) as llm:
            assert llm.engine.model_name == "mine" and llm.engine.model.step_tokens == 256
            params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
            drawn.append([o.outputs[0].token_ids for o in llm.generate(["Once upon", "The river"], params)])
    assert drawn[0] == drawn[1]
    with pytest.raises(ValueError, match="seed must be an integer"):
        LLM(seed=2**70)
    with pytest.raises(TypeError, match="trust_remote_code must be true or false"):
        LLM(trust_remote_code="yes")


def test_chat_takes_vllms_arguments(tp2_llm):
    """vLLM's chat arguments: chat_template_kwargs reach the template, continue_final_message
    continues the last message, chat_template replaces the checkpoint's, use_tqdm a bar of the
    caller's; priority other than 0 is refused, since scheduling is first come, first served."""
    params = SamplingParams(temperature=0.0, max_tokens=2)
    hello = [{"role": "user", "content": "Hello there"}]
    off = tp2_llm.chat(hello, params, chat_template_kwargs={"enable_thinking": False})[0].prompt
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    started = hello + [{"role": "assistant", "content": "General Kenobi, "}]
    out = tp2_llm.chat(started, params, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nGeneral Kenobi, ")  # no <|im_end|>
    with pytest.raises(ValueError, match="needs add_generation_prompt false"):
        tp2_llm.chat(started, params, continue_final_message=True)
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert tp2_llm.chat(hello, params, chat_template=plain)[0].prompt == "user: Hello there\n"
    bars = []

    class Bar:
        def __init__(self, total, desc):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            pass

    tp2_llm.generate(["a", "b", "c"], params, use_tqdm=Bar)
    assert [(b.total, b.n) for b in bars] == [(3, 3)]
    assert len(tp2_llm.generate("a", params, use_tqdm=False, priority=0)) == 1
    with pytest.raises(ValueError, match="priority scheduling is not supported"):
        tp2_llm.generate("a", params, priority=1)


def test_bad_words_are_not_written(tp2_llm):
    tok = tp2_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = tp2_llm.generate("The quick brown fox", params)[0].outputs[0]
    word = tok.decode(plain.token_ids[:1]).strip()
    assert word  # the default model's first token here is a word, so the test says something
    banned = tp2_llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                                    bad_words=[word]))[0].outputs[0]
    assert banned.token_ids[0] != plain.token_ids[0]
    assert not any(ids == banned.token_ids[i:i + len(ids)] for ids in (tok.encode(word), tok.encode(" " + word))
                   for i in range(len(banned.token_ids)))


def test_logprobs_are_vllms_logprob_objects(tp2_llm):
    """Each entry a Logprob: still the float it was, with `.logprob`, `.rank` in the vocabulary
    (the sampled token's found by the engine over every token) and `.decoded_token`."""
    from neuron import Logprob

    tok = tp2_llm.get_tokenizer()
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = tp2_llm.generate("The quick brown fox", params)[0]
    sampled_ranks = []
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert all(isinstance(lp, Logprob) and lp.logprob == lp for lp in entry.values())
        assert all(lp.decoded_token == tok.decode([t], skip_special_tokens=False) for t, lp in entry.items())
        top = sorted((t for t in entry if t != token or entry[t].rank <= 3), key=lambda t: -entry[t])
        assert [entry[t].rank for t in top][:3] == [1, 2, 3]
        first = entry[token]
        assert first.rank == 1 + sum(v > first for v in entry.values()) or first.rank > 3
        sampled_ranks.append(first.rank)
    assert max(sampled_ranks) > 1  # the draws are not all greedy, so the ranks say something
    for pos, entry in enumerate(out.prompt_logprobs):
        if entry is None:
            continue
        first = next(iter(entry.values()))
        assert isinstance(first, Logprob) and first.rank == out.prompt_token_ranks[pos]
    greedy = tp2_llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=4, logprobs=1))[0]
    assert all(entry[t].rank == 1 for t, entry in zip(greedy.outputs[0].token_ids, greedy.outputs[0].logprobs))


@pytest.mark.slow
def test_workers_exit_with_the_interpreter(tmp_path):
    """Forgetting shutdown() must not leave workers behind."""
    script = textwrap.dedent(f"""
        import os
        os.environ["NEURON_CACHE_DIR"] = {str(fresh_cache(tmp_path))!r}
        from neuron import LLM
        llm = LLM(tensor_parallel_size=2, device="cpu", max_model_len=64)
        print(llm.engine.executor.pool.workers[0].proc.pid, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.strip().splitlines()[-1])
    wait_until(lambda: gone(pid), 10, f"worker {pid} outlived its leader")


def test_a_bad_prompt_refuses_the_whole_call(tp2_llm):
    """Nothing of a refused call stays queued to leak into the next one."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with pytest.raises(RequestError):
        tp2_llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": []}], params)
    assert not tp2_llm.engine.has_unfinished()
    assert len(tp2_llm.generate("Hi", params)) == 1


@pytest.mark.slow
def test_recovers_after_a_worker_dies(tp2_llm):
    import os
    import signal

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = tp2_llm.generate("Recovery check", params)[0].outputs[0].token_ids
    victim = tp2_llm.engine.executor.pool.workers[0].proc
    os.kill(victim.pid, signal.SIGKILL)
    # noticed between calls, without a step
    wait_until(lambda: tp2_llm.engine.failure is not None, 10, "the dead worker went unnoticed")
    after = tp2_llm.generate("Recovery check", params)[0].outputs[0].token_ids
    assert after == before
