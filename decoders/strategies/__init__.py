"""The built-in strategies, one file each; importing this package registers them all.

Add a strategy: a new file here (or in your own package) with a `Decoder` or `DraftVerify` subclass decorated with
`@decoders.register("name")` - see speculative.py for the smallest complete example.
"""

from decoders.strategies import (  # noqa: F401
    auto, greedy, guided, lookahead, prompt_lookup, speculative, staged, suffix, threshold,
)
