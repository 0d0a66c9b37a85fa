"""The output processor without an engine: text deltas, finish decisions and logprob shapes."""

from __future__ import annotations

import pytest

from neuron.engine.output_processor import OutputProcessor, Update
from neuron.engine.sampling_params import SamplingParams
from neuron.engine.sequence import Sequence
from neuron.engine.tokenizer import Tokenizer
from neuron.entrypoints.openai.logprobs import LogprobRenderer
from neuron.utils import default_checkpoint as default_ckpt

TEXT = "Hello world, stop here. The end"
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEURON_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return Tokenizer.from_dir(default_ckpt.default_model_dir())


def admitted(processor: OutputProcessor, tokenizer: Tokenizer, max_tokens: int = 32, **params) -> Sequence:
    seq = Sequence("r1", tokenizer.encode("Say:"), SamplingParams(**params), None, max_tokens)
    processor.add(seq)
    return seq


def feed(processor: OutputProcessor, seq: Sequence, tokens: list[int]) -> list[Update]:
    """What the engine does per sampled token, until the request finishes."""
    updates = []
    for token in tokens:
        seq.output_token_ids.append(token)
        updates.append(processor.process(seq, token, None))
        if updates[-1].finished:
            break
    return updates


def test_stop_string_cuts_text_and_holds_back_its_prefix(tokenizer):
    processor = OutputProcessor(tokenizer, [tokenizer.eos_token_id], MAX_MODEL_LEN)
    seq = admitted(processor, tokenizer, stop=["stop here"])
    updates = feed(processor, seq, tokenizer.encode(TEXT))
    # Eight characters stay back while they might begin "stop here"; the stop string never shows.
    assert [u.text for u in updates] == ["", "", "", "H", "el", "l", "o w", "o", "r", "ld,", " "]
    assert (updates[-1].finished, updates[-1].finish_reason, updates[-1].stop_reason) == (True, "stop", "stop here")
    assert processor.sequence("r1") is None  # a finished request is no longer tracked


def text(updates: list[Update]) -> str:
    return "".join(u.text for u in updates)


def test_eos_and_stop_tokens_are_not_output_unless_asked(tokenizer):
    """As vLLM: the EOS or stop token that ends a sequence adds no text, unless
    include_stop_str_in_output (then a stop token's text stays; an EOS's is special, skipped)."""
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hello world")
    processor = OutputProcessor(tokenizer, [eos], MAX_MODEL_LEN)
    updates = feed(processor, admitted(processor, tokenizer), [*ids, eos])
    assert text(updates) == "Hello world"
    assert (updates[-1].finish_reason, updates[-1].stop_reason, updates[-1].num_output_tokens) == ("stop", None, 6)
    updates = feed(processor, admitted(processor, tokenizer, stop_token_ids=[ids[1]]), ids)
    assert text(updates) == "H"
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == ("stop", ids[1])
    updates = feed(processor, admitted(processor, tokenizer, stop_token_ids=[ids[1]], include_stop_str_in_output=True),
                   ids)
    assert text(updates) == "Hell" and updates[-1].stop_reason == ids[1]
    updates = feed(processor, admitted(processor, tokenizer, include_stop_str_in_output=True), [*ids, eos])
    assert text(updates) == "Hello world" and updates[-1].finish_reason == "stop"


def test_a_stop_string_the_last_allowed_token_completes_ends_the_text_there(tokenizer):
    """The length limit does not hide a stop string its last token completes: the text is cut
    before it and the request stops on it, as vLLM finds them."""
    processor = OutputProcessor(tokenizer, [tokenizer.eos_token_id], MAX_MODEL_LEN)
    ids = tokenizer.encode(TEXT)  # H|ell|o| wor|ld|,| st|o|p| he|re|.
    updates = feed(processor, admitted(processor, tokenizer, max_tokens=9, stop=["top"]), ids)
    assert len(updates) == 9 and text(updates) == "Hello world, s"
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == ("stop", "top")
    updates = feed(processor, admitted(processor, tokenizer, max_tokens=8, stop=["top"]), ids)
    assert text(updates) == "Hello world, sto" and updates[-1].finish_reason == "length"


def test_min_tokens_text_never_ends_in_a_stop_string(tokenizer):
    """A stop string that ends within the first min_tokens tokens' text is passed over (the text keeps
    it), one that ends later stops it even where it begins earlier, and nothing shown is taken back."""
    processor = OutputProcessor(tokenizer, [tokenizer.eos_token_id], MAX_MODEL_LEN)
    ids = tokenizer.encode(TEXT)  # H|ell|o| wor|ld|,| st|o|p| he|re|.
    updates = feed(processor, admitted(processor, tokenizer, min_tokens=3, stop=["ell", "."]), ids)
    assert text(updates) == "Hello world, stop here" and updates[-1].stop_reason == "."
    updates = feed(processor, admitted(processor, tokenizer, min_tokens=7, stop=["sto"]), ids)
    assert text(updates) == "Hello world, " and updates[-1].stop_reason == "sto"  # " st" is token 7, "o" 8
    updates = feed(processor, admitted(processor, tokenizer, min_tokens=8, stop=["sto", " The"]), ids)
    assert text(updates) == "Hello world, stop here." and updates[-1].stop_reason == " The"
    updates = feed(processor, admitted(processor, tokenizer, max_tokens=14, min_tokens=14, stop=["e"]), ids)
    assert text(updates) == TEXT and updates[-1].finish_reason == "length"


def test_the_stop_string_that_ends_first_wins_and_can_stay_in_the_text(tokenizer):
    processor = OutputProcessor(tokenizer, [tokenizer.eos_token_id], MAX_MODEL_LEN)
    ids = tokenizer.encode(TEXT)
    updates = feed(processor, admitted(processor, tokenizer, stop=[" world", "wo"]), ids)
    assert text(updates) == "Hello " and updates[-1].stop_reason == "wo"  # it ends before " world" does
    updates = feed(processor, admitted(processor, tokenizer, stop=["stop", "."], include_stop_str_in_output=True), ids)
    assert text(updates) == "Hello world, stop" and updates[-1].stop_reason == "stop"
    # nothing held back where the stop string stays: each token's text goes out with it
    assert [u.text for u in updates][:3] == ["H", "ell", "o"]


def test_min_tokens_defers_eos_and_length_ends(tokenizer):
    eos = tokenizer.eos_token_id
    processor = OutputProcessor(tokenizer, [eos], MAX_MODEL_LEN)
    seq = admitted(processor, tokenizer, max_tokens=3, min_tokens=2)
    updates = feed(processor, seq, [eos, eos, eos])
    assert [u.finished for u in updates] == [False, True]
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == ("stop", None)
    seq = admitted(processor, tokenizer, max_tokens=3)
    updates = feed(processor, seq, tokenizer.encode(TEXT))
    assert len(updates) == 3 and (updates[-1].finish_reason, updates[-1].text) == ("length", "o")


def test_end_reports_held_back_text_with_the_sequences_reason(tokenizer):
    processor = OutputProcessor(tokenizer, [tokenizer.eos_token_id], MAX_MODEL_LEN)
    seq = admitted(processor, tokenizer, stop=["zzzz"])
    updates = feed(processor, seq, tokenizer.encode("Hello world"))
    assert "".join(u.text for u in updates) == "Hello wo"  # three characters might begin "zzzz"
    seq.finish_reason = "abort"  # what the scheduler sets when it retires the sequence
    last = processor.end(seq, error="gone")
    assert (last.text, last.finished, last.finish_reason, last.error, last.token_ids) == ("rld", True, "abort",
                                                                                         "gone", [])


def test_without_a_tokenizer_there_is_no_text(tokenizer):
    processor = OutputProcessor(None, [7], MAX_MODEL_LEN)
    seq = admitted(processor, tokenizer, stop=["a"])
    updates = feed(processor, seq, [5, 6, 7])
    assert [u.text for u in updates] == ["", "", ""]
    assert [u.token_ids for u in updates] == [[5], [6], [7]] and updates[-1].finish_reason == "stop"


def test_chat_logprobs_rank_and_clamp(tokenizer):
    a, b, c = tokenizer.encode("Hello")
    render = LogprobRenderer(tokenizer, as_ids=False)
    (entry,) = render.chat([a], [{a: -0.5, b: -0.25, c: float("-inf")}], 2)
    assert (entry.token, entry.logprob, entry.bytes) == ("H", -0.5, [72])
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [("ell", -0.25), ("H", -0.5)]
    (entry,) = LogprobRenderer(tokenizer, as_ids=True).chat([c], [{c: float("-inf")}], 1)
    assert (entry.token, entry.logprob) == (f"token_id:{c}", -9999.0)
    assert entry.top_logprobs[0].bytes == list(f"token_id:{c}".encode())


def test_completion_logprobs_count_text_offsets_across_updates(tokenizer):
    ids = tokenizer.encode("Hello world")
    render = LogprobRenderer(tokenizer, as_ids=True)
    first = render.completion(ids[:2], [{ids[0]: -1.0}, {ids[1]: -2.0, ids[0]: -3.0}])
    second = render.completion(ids[2:], [{t: -1.0} for t in ids[2:]])
    assert first.tokens == [f"token_id:{ids[0]}", f"token_id:{ids[1]}"]
    assert first.top_logprobs[1] == {f"token_id:{ids[1]}": -2.0, f"token_id:{ids[0]}": -3.0}
    assert first.text_offset + second.text_offset == [0, 1, 4, 5, 9]  # "H", "ell", "o", " wor", "ld"
    assert LogprobRenderer(None, as_ids=False).completion([3], [{3: -1.0}]).text_offset == [0]
