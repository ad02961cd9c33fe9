"""The built-in strategies, one file each, registered on import. A new one: a `Decoder` or `DraftVerify` subclass
decorated with `@decoders.register("name")`, here or in your own package (speculative.py is the smallest example)."""

from decoders.strategies import auto, greedy, guided, lookahead, prompt_lookup, speculative, staged, suffix, threshold

__all__ = ["auto", "greedy", "guided", "lookahead", "prompt_lookup", "speculative", "staged", "suffix", "threshold"]
