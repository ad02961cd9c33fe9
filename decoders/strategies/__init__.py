"""The built-in strategies, registered on import. A new one: a `Decoder` or `DraftVerify` subclass under
`@decoders.register("name")`, here or in your own package."""

from decoders.strategies import auto, greedy, guided, lookahead, prompt_lookup, speculative, staged, suffix, threshold

__all__ = ["auto", "greedy", "guided", "lookahead", "prompt_lookup", "speculative", "staged", "suffix", "threshold"]
