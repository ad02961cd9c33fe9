"""decodekit's decoding strategies over any Hugging Face causal LM, all lossless against greedy decoding
(layout: docs/design/architecture.md).

    lm = decoders.load("zoo:smollm2-135m")
    result = decoders.generate(lm, "The capital of France is", strategy="greedy", max_new_tokens=32)
    results = decoders.generate(lm, ["def add(a, b):", "Once upon a time"], strategy="suffix")  # batched
"""

from decoders.base import Chunk, Decoder, DecodeState, Result, Stats
from decoders.drafting import Draft, DraftVerify
from decoders.drafting.chooser import Offer
from decoders.drafting.suffix_store import SuffixStore
from decoders.driver import generate, stream
from decoders.models.cache import KVCache
from decoders.models.lm import LM, wrap
from decoders.models.loading import load
from decoders.proposers.base import Fixed, Proposer
from decoders.registry import available, register, unregister


def quantize(lm: LM, scheme: str = "int8") -> LM:
    """A new `LM` whose linear layers run on `scheme` (e.g. "int8") weights: a cheap draft; `lm` is left untouched."""
    from decoders.models.quantize import quantize as quantized

    return quantized(lm, scheme)


from decoders import strategies  # noqa: E402,F401  isort: skip  (registers the built-in strategies)

__all__ = [
    "LM",
    "KVCache",
    "Decoder",
    "DecodeState",
    "Result",
    "Stats",
    "Chunk",
    "Draft",
    "DraftVerify",
    "Proposer",
    "Offer",
    "Fixed",
    "SuffixStore",
    "load",
    "wrap",
    "quantize",
    "available",
    "register",
    "unregister",
    "generate",
    "stream",
]
