"""Peers: what users would otherwise run, timed in the same run as decodekit's strategies.

`hf:greedy`, `hf:assisted` (needs a draft) and `hf:prompt_lookup` call transformers' own `model.generate` with
do_sample=False on the same model, prompt tokens, dtype and max_new_tokens, with every logits processor a model's
generation config might switch on (repetition penalty, n-gram blocking) turned off. A streamer notes when tokens
arrive (time to first token, the sparkline); torch forward hooks count target and draft calls. `outlines:` peers
(grammar-constrained generation through outlines' logits processor) are listed but not implemented yet.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import torch
import transformers
from transformers.generation.streamers import BaseStreamer

import decoders
from evals.timing import Run, Stopwatch, pieces


@dataclass(frozen=True)
class Peer:
    """One transformers generation path."""

    name: str
    needs_draft: bool = False
    source: str = "target"  # what to call the tokens accepted with a target call's last token (all but that one)
    kwargs: dict = field(default_factory=dict)  # extra `generate` arguments
    description: str = ""


PEERS = {
    peer.name: peer
    for peer in (
        Peer("hf:greedy", description="transformers generate(do_sample=False)"),
        Peer("hf:assisted", needs_draft=True, source="draft",
             description="transformers assisted generation, generate(assistant_model=draft)"),
        Peer("hf:prompt_lookup", source="lookup", kwargs={"prompt_lookup_num_tokens": 10},
             description="transformers prompt lookup, generate(prompt_lookup_num_tokens=10)"),
    )
}
UNAVAILABLE = {"outlines:": "the outlines peer is not implemented yet (its JSON-schema masks admit non-canonical "
                            "tokenizations, so it needs its own greedy reference)"}


def is_peer(name: str) -> bool:
    """True for peer names (`hf:...`, `outlines:...`)."""
    return name.startswith(("hf:", "outlines:"))


def unavailable(name: str) -> str | None:
    """Why peer `name` cannot run here, or None if it can."""
    return next((why for prefix, why in UNAVAILABLE.items() if name.startswith(prefix)), None)


def get(name: str) -> Peer:
    """The peer called `name`; an unknown one raises with the known names."""
    if name in PEERS:
        return PEERS[name]
    if unavailable(name):
        return Peer(name, description=unavailable(name))
    nearest = difflib.get_close_matches(name, list(PEERS), n=1, cutoff=0.5)
    hint = f" Did you mean {nearest[0]!r}?" if nearest else ""
    raise ValueError(f"unknown peer {name!r}.{hint} Known peers: {', '.join(PEERS)}, outlines:<name>")


class _Arrivals(BaseStreamer):
    """A transformers streamer that notes the time and count of arriving tokens (the first `put` is the prompt)."""

    def __init__(self, watch: Stopwatch) -> None:
        self.watch, self.prompt_seen, self.count, self.chunks = watch, False, 0, []

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        n = value.numel()
        self.count += n
        self.chunks.append(n)
        self.watch.mark(self.count)

    def end(self) -> None:
        pass


def _quiet_generate(model, **kwargs) -> torch.Tensor:
    """`model.generate` with transformers' advisory warnings (unused sampling flags, deprecations) silenced."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return model.generate(**kwargs)
    finally:
        transformers.logging.set_verbosity(verbosity)


def run_peer(
    lm: decoders.LM,
    prompt: list[int],
    name: str,
    *,
    max_new_tokens: int,
    draft: decoders.LM | None = None,
    prompt_id: str = "",
    category: str = "",
    repeat: int = 0,
) -> Run:
    """Time one transformers `generate` call of peer `name`."""
    peer = get(name)
    if unavailable(name):
        raise ValueError(f"peer {name!r} is not available: {unavailable(name)}")
    if peer.needs_draft and draft is None:
        raise ValueError(f"peer {name!r} needs a draft model: pass --draft")
    ids = torch.tensor([prompt], dtype=torch.long, device=lm.device)  # [1, T]
    eos = sorted(lm.eos_token_ids)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    kwargs = dict(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        do_sample=False, num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0,
        eos_token_id=eos or None, pad_token_id=pad, **peer.kwargs,
    )
    if peer.needs_draft:
        kwargs["assistant_model"] = draft.model
    watch = Stopwatch(lm, draft if peer.needs_draft else None, count_target=True)
    arrivals = _Arrivals(watch)
    with watch:
        output = _quiet_generate(lm.model, streamer=arrivals, **kwargs)
    tokens = output[0, ids.shape[1]:].tolist()
    sources = [s for n in arrivals.chunks for s in [peer.source] * (n - 1) + ["target"]]
    sources = (sources + ["target"] * len(tokens))[: len(tokens)]
    finish = "eos" if tokens and tokens[-1] in lm.eos_token_ids else "length"
    accepted = sum(n - 1 for n in arrivals.chunks) if peer.source != "target" else None
    return Run(
        strategy=name, kind="peer", prompt_id=prompt_id, category=category, repeat=repeat,
        prompt_tokens=len(prompt), max_new_tokens=max_new_tokens, new_tokens=len(tokens),
        seconds=watch.seconds, ttft_seconds=watch.ttft,
        target_calls=watch.target.calls, draft_calls=watch.draft.calls if watch.draft_metered else None,
        drafted=None, accepted=accepted, accepted_by_position=[], drafted_by_position=[],
        draft_seconds=watch.draft.seconds if watch.draft_metered else None,
        peak_memory_bytes=watch.peak_bytes, finish_reason=finish,
        tokens=tokens, sources=sources, pieces=pieces(lm, tokens), timeline=watch.marks,
    )
