from __future__ import annotations

from decoders.base import Decoder, DecodeState, Steps
from decoders.registry import register


@register("greedy")
class Greedy(Decoder):
    """One target call per token: score the uncached tail (the whole prompt on the first step), pick the next token.
    The reference every other strategy reproduces."""

    def steps(self, state: DecodeState) -> Steps:
        logits = yield state.call()  # [1, vocab]: only the last position predicts a new token
        state.accept([state.choose(logits[-1])], ["target"], rows=logits[-1:])
