"""`suffix`: suffix decoding (Oliaro et al. 2024, "SuffixDecoding"). One-hot drafts: exact in both modes."""

from __future__ import annotations

from dataclasses import dataclass

from decoders.base import DecodeState
from decoders.drafting import DraftVerify
from decoders.drafting.suffix_index import SuffixOptions
from decoders.drafting.suffix_store import SuffixStore
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


def suffix_trees(state: DecodeState, options: SuffixDecodingOptions) -> SuffixProposer:
    """The suffix index's whole tree each step, the run's output (and prompt) remembered in the store."""
    return SuffixProposer(state, options, options.store, remember_prompts=options.remember_prompts)


@register("suffix")
class Suffix(DraftVerify):
    """Draft-free decoding: token trees from a suffix index of the context and of earlier outputs."""

    Options = SuffixDecodingOptions
    drafter = Fixed.of(suffix_trees)
    needs_tree_mask = True
