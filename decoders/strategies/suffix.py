"""`suffix`: suffix decoding - no draft model; continuations of the longest matching context suffix, as a tree.

Oliaro et al. 2024, "SuffixDecoding" (arXiv 2411.04975; Snowflake ArcticInference, vLLM method="suffix"). Each step
matches the longest suffix of the context (up to `max_match` tokens) in a counted suffix trie over the prompt and the
output so far, and - with `store=` a `decoders.SuffixStore` - over earlier outputs too (a server's memory: requests that
repeat what earlier requests produced). From the match it grows a token tree best first by how often each
continuation followed it, at most `depth_factor` x the match length nodes (a longer match earns a bigger tree), never
a path rarer than `min_prob`; the target checks the whole tree in one call. Against prompt lookup, which copies one
chain after the most recent match of at most a few tokens, the tree holds the other continuations seen, and the
length of the match decides how much to draft.

The data structure is `decoders.drafting.suffix_index`; drafts are deterministic (one-hot for the verifier), so the
strategy is exact in greedy and in sampling mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from decoders.base import DecodeState
from decoders.drafting import DraftVerify
from decoders.drafting.suffix_index import SuffixOptions, SuffixStore
from decoders.options import check_flags
from decoders.proposers.base import Fixed
from decoders.proposers.suffix import SuffixProposer
from decoders.registry import register


@dataclass(frozen=True)
class SuffixDecodingOptions(SuffixOptions):
    """Options of `suffix`: those of the suffix trees (`SuffixOptions`), plus the memory across calls."""

    store: SuffixStore | None = None  # earlier outputs to draft from; this run's output is added when it ends
    remember_prompts: bool = False  # also add this run's prompt to the store

    def __post_init__(self):
        super().__post_init__()
        check_flags(self)
        if self.store is not None and not isinstance(self.store, SuffixStore):
            raise TypeError(f"store= takes a decoders.SuffixStore, got {type(self.store).__name__}")


def suffix_drafter(state: DecodeState, options: SuffixDecodingOptions) -> Fixed:
    """The suffix index's whole tree each step."""
    return Fixed(SuffixProposer(state, options, options.store, remember_prompts=options.remember_prompts))


@register("suffix")
class Suffix(DraftVerify):
    """Draft-free decoding: token trees from a suffix index of the context and of earlier outputs."""

    Options = SuffixDecodingOptions
    drafter = staticmethod(suffix_drafter)
    needs_tree_mask = True
