"""Speculative decoding: cheap proposals for a sequence's next tokens, scored by the target model in
one step and kept as far as the target agrees.

After a step's sampling, each decoding sequence is given up to k proposed tokens (its
`draft_token_ids`); the scheduler reserves their blocks and schedules them behind the sequence's
last token, and the step returns logits for all k + 1 positions. The engine then samples (this
package's `SpecDecoder.verify`) position by position exactly as a plain decode would
(penalties, grammar, seed and all, each position seeing the tokens kept before it) and keeps going
while the sampled token equals the proposal. The first token that differs is kept too (it is a
sample from the target's distribution at that position), and the proposals after it are dropped:
their keys and values sit past the sequence's computed length and are overwritten later. For a
proposal that is a fixed guess (n-gram) this is exactly rejection sampling: the proposal survives
with the target's probability of it, and a rejected position's token is drawn from the target's
distribution without the proposal. So output equals non-speculative decoding, greedy or sampled,
seeded requests included; only the number of target steps changes.

The package holds all of it: the settings (`config`), the proposers (the `method`: `ngram.py`,
`suffix.py`, `draft.py`), the acceptance (`acceptance.py`) and the engine's side of it
(`SpecDecoder`: when to propose and how much, the verifying, the counts). The scheduler only
schedules what it is given; it never runs a model.

Proposers: `ngram` (prompt lookup: the longest recent n-gram, prompt_lookup_max
down to prompt_lookup_min tokens, found earlier in prompt + output, proposes what followed it
there); `suffix` (suffix.py: the request's own tokens, and a count-keeping index of earlier
requests' outputs bounded in bytes, propose the continuation most often seen, as far as it stays
likely); `draft` (draft.py: a smaller checkpoint with the same vocabulary proposes its own greedy
continuation). Each is a fixed guess given the tokens so far, which is what keeps the
position-by-position sampling exact.

Adaptive: a sequence's k follows its acceptance (an exponential average). For lookups, which cost
nothing to propose: k_max while a fair share is taken, one token when few are, none while it is
poor, with a retry now and then. For a draft, whose every token costs a draft step (its weights
against the target's): the k that yields most tokens per unit of time, none where no k beats a
plain step. No sequence speculates in a step with more than `disable_by_batch_size` decoding
sequences, or in one that prefills, where the step is already bound by compute rather than by
reading the weights.
"""
from neuron.engine.spec_decode.config import COMMON_KEYS, METHOD_KEYS, METHODS, SpeculativeConfig
from neuron.engine.spec_decode.decoder import SpecDecoder

__all__ = ["COMMON_KEYS", "METHODS", "METHOD_KEYS", "SpecDecoder", "SpeculativeConfig"]
