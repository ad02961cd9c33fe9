"""`guided`: grammar-constrained decoding that skips the model wherever the grammar alone decides the next tokens.

Each step first accepts the run of tokens the grammar forces (`Matcher.forced()`, source "grammar") without calling
the model. The target cache lags behind them, so the step's one target call scores the uncached tail - the previous
chosen token plus the forced ones, as a prefill - and the next token is chosen under the grammar's mask. A forced token
costs a prefill position, not a decode step.

Lossless: forced tokens have probability 1 under the masked distribution, and `DecodeState.choose` returns a forced
token without drawing from the random stream. So in greedy mode `guided` equals `greedy` with the same grammar token
for token, and in sampling mode it follows the same masked target distribution; it only saves calls.
"""

from __future__ import annotations

from decoders.base import DecodeState, Decoder, Steps
from decoders.registry import register


@register("guided")
class Guided(Decoder):
    """Greedy or sampled decoding under a grammar, with forced tokens fast-forwarded instead of decoded."""

    needs_grammar = True

    def steps(self, state: DecodeState) -> Steps:
        forced = state.grammar.forced()
        if forced:
            state.accept(forced, ["grammar"] * len(forced))
            if state.finished:  # the grammar completed, or max_new_tokens ran out
                return
        logits = yield state.call()  # [1, vocab]: scores the uncached tail, forced tokens included, in one call
        state.accept([state.choose(logits[-1])], ["target"], rows=logits[-1:])
