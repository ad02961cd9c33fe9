from __future__ import annotations

from decoders.base import Decoder, DecodeState, Steps
from decoders.registry import register


@register("guided")
class Guided(Decoder):
    """Greedy or sampled decoding under a grammar, with forced tokens fast-forwarded instead of decoded.
    A forced token takes no call, is scored in the next and has probability 1: lossless."""

    needs_grammar = True

    def steps(self, state: DecodeState) -> Steps:
        forced = state.grammar.forced()
        if forced:
            state.accept(forced, ["grammar"] * len(forced))
            if state.finished:  # the grammar completed, or max_new_tokens ran out
                return
        logits = yield state.call()  # [1, vocab]: scores the uncached tail, forced tokens included, in one call
        state.accept([state.choose(logits[-1])], ["target"], rows=logits[-1:])
