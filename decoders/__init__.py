"""decodekit's decoding strategies over any Hugging Face causal LM, all lossless against greedy decoding.

    lm = decoders.load("zoo:smollm2-135m")
    result = decoders.generate(lm, "The capital of France is", strategy="greedy", max_new_tokens=32)
"""

from decoders.base import Chunk, DecodeState, Decoder, Result, Stats
from decoders.cache import KVCache
from decoders.driver import generate, stream
from decoders.lm import LM, load, wrap
from decoders.registry import available, register, unregister

# Built-in strategies register themselves on import.
from decoders import greedy, lookahead, prompt_lookup, speculative, staged, threshold  # noqa: E402,F401  isort: skip
from decoders import guided  # noqa: E402,F401  isort: skip

__all__ = [
    "LM", "KVCache", "Decoder", "DecodeState", "Result", "Stats", "Chunk",
    "load", "wrap", "available", "register", "unregister", "generate", "stream",
]
