"""Peers: what users would otherwise run, timed in the same run as decodekit's strategies.

`hf:greedy`, `hf:assisted` (needs a draft) and `hf:prompt_lookup` call transformers' own `model.generate` with
do_sample=False on the same model, prompt tokens, dtype and max_new_tokens, with every logits processor a model's
generation config might switch on (repetition penalty, n-gram blocking) turned off. A streamer notes when tokens
arrive (time to first token, the sparkline); torch forward hooks count target and draft calls.

`outlines:json` runs on prompts with a schema: the same `generate` call with outlines' JSON-schema logits processor
(what `outlines.Generator(outlines.from_transformers(model, tokenizer), JsonSchema(...))` does, fed the same prompt
tokens), built once per model and schema, outside the timed call. Its mask admits every tokenization of the allowed
text, so its tokens may differ from `guided`'s (which keeps the tokenizer's own spelling); its output is checked for
validity against the schema instead of token equality.

`llamacpp:greedy`, `llamacpp:draft` and `llamacpp:ngram` run llama.cpp's `llama-server` on a GGUF of the same weights
(`evals.llamacpp`); they run only when named, and need a llama.cpp build (`decodekit peers install llamacpp`).

`hf:batch` and `hf:continuous` run only in a batched compare (`--batch-size N`, `evals.batched`): transformers
`generate(do_sample=False)` on left-padded batches of N prompts, and transformers' continuous batching
(`generate_batch`, N requests in flight) where it runs on the device. The one-prompt peers run only without it.
"""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from transformers.generation.streamers import BaseStreamer

import decoders
from decoders.models.attention import stock
from evals.timing import Run, Stopwatch, pieces


@dataclass(frozen=True)
class Peer:
    """One transformers generation path."""

    name: str
    needs_draft: bool = False  # the needs, declared like a strategy's, so `decoders.capabilities` checks peers too
    source: str = "target"  # what to call the tokens accepted with a target call's last token (all but that one)
    kwargs: dict = field(default_factory=dict)  # extra `generate` arguments
    description: str = ""
    needs_grammar: bool = False  # runs only on prompts with a schema, under outlines' logits processor
    takes_draft: bool = False  # uses a draft only when it needs one
    needs_tree_mask: bool = False
    draft_needs_tree_mask: bool = False
    batched: bool = False  # decodes the whole suite as one queue: runs only in a batched compare (--batch-size)
    engine: str = "transformers"  # what runs it: "transformers" (`run_peer`) or "llamacpp" (`evals.llamacpp`)
    settings: dict = field(default_factory=dict)  # its @settings and their defaults (none: it takes no options)


PEERS = {
    peer.name: peer
    for peer in (
        Peer("hf:greedy", description="transformers generate(do_sample=False)"),
        Peer(
            "hf:assisted",
            needs_draft=True,
            source="draft",
            description="transformers assisted generation, generate(assistant_model=draft)",
        ),
        Peer(
            "hf:prompt_lookup",
            source="lookup",
            kwargs={"prompt_lookup_num_tokens": 10},
            description="transformers prompt lookup, generate(prompt_lookup_num_tokens=10)",
        ),
        Peer(
            "outlines:json",
            needs_grammar=True,
            description="outlines' JSON-schema logits processor in transformers generate (prompts with a schema)",
        ),
    )
}
BATCH_PEERS = {  # the peers of a batched compare (--batch-size N), timed by `evals.batched`
    peer.name: peer
    for peer in (
        Peer(
            "hf:batch",
            batched=True,
            description="transformers generate(do_sample=False) on left-padded batches of N prompts",
        ),
        Peer(
            "hf:continuous",
            batched=True,
            description="transformers continuous batching, generate_batch (N requests in flight)",
        ),
    )
}
LLAMACPP_PEERS = {  # llama.cpp's llama-server on a GGUF of the same weights: run only when named in --strategies
    peer.name: peer
    for peer in (
        Peer("llamacpp:greedy", engine="llamacpp", description="llama.cpp's llama-server, greedy, same weights"),
        Peer(
            "llamacpp:draft",
            needs_draft=True,
            source="draft",
            engine="llamacpp",
            settings={"n_max": 3, "n_min": 0, "p_min": 0.0},  # llama.cpp's own defaults (common/common.h)
            description="llama.cpp's draft-model speculation (--spec-type draft-simple) with the --draft model",
        ),
        Peer(
            "llamacpp:ngram",
            source="lookup",
            engine="llamacpp",
            settings={"n_match": 24, "n_min": 48, "n_max": 64},  # its --spec-default
            description="llama.cpp's draft-free speculation, --spec-type ngram-mod",
        ),
    )
}
UNAVAILABLE = {} if importlib.util.find_spec("outlines") else {"outlines:": "outlines is not installed"}


def is_peer(name: str) -> bool:
    """True for peer names (`hf:...`, `outlines:...`, `llamacpp:...`)."""
    return name.startswith(("hf:", "outlines:", "llamacpp:"))


def unavailable(name: str) -> str | None:
    """Why peer `name` cannot run here, or None if it can."""
    return next((why for prefix, why in UNAVAILABLE.items() if name.startswith(prefix)), None)


def get(name: str) -> Peer:
    """The peer called `name` (one of PEERS, BATCH_PEERS or LLAMACPP_PEERS); an unknown one raises with the known
    names."""
    known = {**PEERS, **BATCH_PEERS, **LLAMACPP_PEERS}
    if name in known:
        return known[name]
    if unavailable(name):
        return Peer(name, description=unavailable(name))
    nearest = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
    hint = f" Did you mean {nearest[0]!r}?" if nearest else ""
    raise ValueError(f"unknown peer {name!r}.{hint} Known peers: {', '.join(known)}")


_PROCESSORS: dict[tuple, Any] = {}  # (model id, schema, whitespace) -> outlines' logits processor


def _outlines_processor(lm: decoders.LM, grammar: Any):
    """outlines' JSON-schema logits processor for `grammar` (a `grammars.JsonSchema`), built once per model."""
    schema, whitespace = getattr(grammar, "schema", None), getattr(grammar, "whitespace", "")
    if schema is None:
        raise ValueError('outlines:json runs only under a JSON-schema grammar (a suite line with a "schema")')
    key = (id(lm.model), schema, whitespace)
    if key not in _PROCESSORS:
        import outlines
        from outlines.backends import get_json_schema_logits_processor

        model = outlines.from_transformers(lm.model, lm.tokenizer)
        _PROCESSORS[key] = get_json_schema_logits_processor(None, model, schema, whitespace_pattern=whitespace)
    return _PROCESSORS[key]


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


def quiet_generate(model, **kwargs) -> torch.Tensor:
    """`model.generate` with transformers' advisory warnings (unused sampling flags, deprecations) silenced, on
    transformers' own attention (`attention.stock`)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with stock(model, kwargs.get("assistant_model")):
            return model.generate(**kwargs)
    finally:
        transformers.logging.set_verbosity(verbosity)


def pad_token_id(lm: decoders.LM) -> int:
    """The id transformers pads with: the tokenizer's pad token, else the first EOS id, else 0."""
    eos = sorted(lm.eos_token_ids)
    return lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)


def greedy_arguments(lm: decoders.LM) -> dict:
    """The `generate` arguments every transformers peer shares: greedy, one beam, every logits processor a model's
    generation config might switch on turned off, decodekit's EOS ids and the pad id."""
    return dict(
        do_sample=False,
        num_beams=1,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        eos_token_id=sorted(lm.eos_token_ids) or None,
        pad_token_id=pad_token_id(lm),
    )


def run_peer(
    lm: decoders.LM,
    prompt: list[int],
    peer: Peer,
    *,
    max_new_tokens: int,
    draft: decoders.LM | None = None,
    grammar: Any = None,
    prompt_id: str = "",
    category: str = "",
    repeat: int = 0,
) -> Run:
    """Time one transformers `generate` call of `peer` (its needs are checked before any run, by `evals.methods`)."""
    ids = torch.tensor([prompt], dtype=torch.long, device=lm.device)  # [1, T]
    kwargs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        **greedy_arguments(lm),
        **peer.kwargs,
    )
    if peer.needs_draft:
        kwargs["assistant_model"] = draft.model
        sizes = {m.config.get_text_config().vocab_size for m in (lm.model, draft.model)}
        if draft.vocab_key != lm.vocab_key and len(sizes) == 2:
            # transformers' universal assisted decoding translates the assistant's drafts through text. It refuses
            # assistant_tokenizer= when the two vocabulary sizes are equal, and then treats the ids as shared.
            kwargs.update(tokenizer=lm.tokenizer, assistant_tokenizer=draft.tokenizer)
    if peer.needs_grammar:
        processor = _outlines_processor(lm, grammar)
        processor.reset()  # a fresh matcher state for this sequence
        kwargs["logits_processor"] = transformers.LogitsProcessorList([processor])
    watch = Stopwatch(lm, draft if peer.needs_draft else None, count_target=True)
    arrivals = _Arrivals(watch)
    with watch:
        output = quiet_generate(lm.model, streamer=arrivals, **kwargs)
    tokens = output[0, ids.shape[1] :].tolist()
    sources = [s for n in arrivals.chunks for s in [peer.source] * (n - 1) + ["target"]]
    sources = (sources + ["target"] * len(tokens))[: len(tokens)]
    finish = "eos" if tokens and tokens[-1] in lm.eos_token_ids else "length"
    accepted = sum(n - 1 for n in arrivals.chunks) if peer.source != "target" else None
    # every target call scores one token that is not a draft (the prompt, the first time) plus its draft tokens
    drafted = watch.target.tokens - len(prompt) - (watch.target.calls - 1) if accepted is not None else None
    return Run(
        strategy=peer.name,
        kind="peer",
        prompt_id=prompt_id,
        category=category,
        repeat=repeat,
        prompt_tokens=len(prompt),
        max_new_tokens=max_new_tokens,
        new_tokens=len(tokens),
        seconds=watch.seconds,
        ttft_seconds=watch.ttft,
        target_calls=watch.target.calls,
        draft_calls=watch.draft.calls if watch.draft_metered else None,
        drafted=drafted,
        accepted=accepted,
        accepted_by_position=[],
        drafted_by_position=[],
        draft_seconds=watch.draft.seconds if watch.draft_metered else None,
        peak_memory_bytes=watch.peak_bytes,
        finish_reason=finish,
        tokens=tokens,
        sources=sources,
        pieces=pieces(lm, tokens),
        timeline=watch.marks,
        grammar=peer.needs_grammar,
    )
