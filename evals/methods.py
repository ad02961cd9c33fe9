"""Methods: what `compare --strategies` and `generate --strategy` name, parsed and constructed once.

A method is a registered strategy or a peer (`hf:assisted` ...), optionally with settings:

    STRATEGY@KEY=VALUE@KEY=VALUE        speculative@k=3, staged@max_depth=12@min_prob=0.05

Settings let one compare rank several settings of a strategy side by side; `-o KEY=VALUE` (generate) and
`-o STRATEGY.KEY=VALUE` (compare) give options too, and an @setting wins over them. Values are JSON when they parse as
JSON (4, 0.5, true, [1, 2]), else the string itself. `plan` turns the requested names into `Method` records - each
strategy constructed once, its needs checked (`decoders.capabilities.check_request`) before any model loads - and the
runner, the timing and the CLI all work from those records.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import decoders
from decoders import registry
from decoders.capabilities import check_models, check_request
from evals import llamacpp, llamacpp_build, peers
from evals.metrics import BASELINE

PYTHON_WORDS = {"True": True, "False": False, "None": None}  # what a Python user types for JSON's true, false, null


def parse_value(raw: str) -> Any:
    """A command-line option value: JSON when it parses as JSON (4, 0.5, true, [1, 2]) or is Python's True, False or
    None, else the string itself."""
    if raw in PYTHON_WORDS:
        return PYTHON_WORDS[raw]
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def split(name: str) -> tuple[str, dict[str, Any]]:
    """`staged@max_depth=12@min_prob=0.05` -> ("staged", {"max_depth": 12, "min_prob": 0.05})."""
    base, *pairs = name.split("@")
    settings = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"method {name!r}: settings must look like STRATEGY@KEY=VALUE (e.g. speculative@k=3)")
        settings[key] = parse_value(raw)
    return base, settings


def option_pairs(pairs: Iterable[str], scoped: bool) -> dict:
    """`-o` options: KEY=VALUE pairs, or when `scoped` STRATEGY.KEY=VALUE pairs grouped by strategy."""
    out: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"option {pair!r} must look like {'STRATEGY.KEY' if scoped else 'KEY'}=VALUE")
        if scoped:
            strategy, dot, name = key.partition(".")
            if not dot or not name:
                raise ValueError(f"option {pair!r} must name its strategy: STRATEGY.KEY=VALUE (e.g. speculative.k=4)")
            out.setdefault(strategy, {})[name] = parse_value(raw)
        else:
            out[key] = parse_value(raw)
    return out


@dataclass(frozen=True, eq=False)
class Method:
    """One method of a run, parsed and constructed once."""

    name: str  # as written, the label in every table: "speculative@k=3"
    base: str  # the registered strategy or the peer: "speculative", "hf:assisted"
    options: Mapping[str, Any]  # the strategy's options: -o options overridden by @settings
    decoder: decoders.Decoder | None = None  # the constructed strategy; None for a peer
    peer: peers.Peer | None = None  # the peer; None for a strategy

    def with_options(self, **options) -> decoders.Decoder:
        """A new instance of this method's strategy with some options replaced (e.g. a fresh `store=`)."""
        return type(self.decoder)(**{**self.options, **options})

    @property
    def is_peer(self) -> bool:
        return self.peer is not None

    @property
    def declared(self) -> decoders.Decoder | peers.Peer:
        """What declares the method's needs (needs_draft, takes_draft, needs_grammar, needs_tree_mask ...)."""
        return self.peer if self.peer is not None else self.decoder

    @property
    def needs_draft(self) -> bool:
        return self.declared.needs_draft

    @property
    def takes_draft(self) -> bool:
        """A draft model is handed to it (whenever it needs one, or uses one when given)."""
        return self.declared.needs_draft or self.declared.takes_draft

    @property
    def needs_grammar(self) -> bool:
        """It runs only on prompts with a schema, under the prompt's grammar."""
        return self.declared.needs_grammar


def build(name: str, options: Mapping[str, Any] | None = None) -> Method:
    """The method `name` (STRATEGY@KEY=VALUE... or a peer), its strategy constructed with `options` overridden by the
    name's @settings; an unknown strategy, peer or option raises here."""
    return _construct(name, *split(name), options)


def _construct(name: str, base: str, settings: dict[str, Any], options: Mapping[str, Any] | None) -> Method:
    if peers.is_peer(base):
        peer = peers.get(base)
        merged = {**peer.settings, **(options or {}), **settings}
        if (settings or options) and not peer.settings:
            raise ValueError(f"method {name!r}: peers take no options ({base} has no settings)")
        if unknown := sorted(set(merged) - set(peer.settings)):
            raise ValueError(
                f"method {name!r}: unknown setting {', '.join(unknown)}; its settings: "
                f"{', '.join(f'{k}={v}' for k, v in peer.settings.items())}"
            )
        if peer.engine == "llamacpp":
            llamacpp.check_settings(name, merged)
        return Method(name=name, base=base, options=merged, peer=peer)
    merged = {**(options or {}), **settings}
    built = {k: decoders.SuffixStore() if (k, v) == ("store", "run") else v for k, v in merged.items()}
    return Method(name=name, base=base, options=merged, decoder=registry.get(base)(**built))


def batch_conflict(method: Method, batched: bool) -> str | None:
    """Why `method` cannot run in this kind of compare (`batched`: with --batch-size, the suite as one queue), or
    None when it can."""
    if method.is_peer:
        if method.peer.batched and not batched:
            return "runs only in a batched compare: pass --batch-size N"
        if batched and not method.peer.batched:
            return (
                f"decodes one prompt at a time; a batched compare (--batch-size) runs the transformers peers "
                f"{', '.join(peers.BATCH_PEERS)}"
            )
        return None
    if not batched:
        return None
    if method.needs_grammar:
        return (
            "runs only on prompts with a schema, under their grammar; a batched compare (--batch-size) runs "
            "every method on the whole suite"
        )
    if not method.decoder.batchable():
        return "implements `step` only, so its runs cannot share target calls (decoders.base.Decoder.steps)"
    return None


def plan(
    requested: Iterable[str],
    has_draft: bool,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    batched: bool = False,
    llamacpp_dir: str | None = None,
) -> tuple[list[Method], list[str]]:
    """The methods of a compare (the baseline first) and notes on what was skipped, before any model loads.

    `requested` empty means every registered strategy and peer whose needs are met (`batched`, a compare with
    --batch-size: the batched peers instead of the one-prompt ones, and only strategies that batch; the llama.cpp
    peers only when named). `options` holds each strategy's -o options ({"speculative": {"k": 4}}). `llamacpp_dir`: the
    folder of the llama.cpp build (default: the one `decodekit peers install llamacpp` makes), which the llama.cpp
    peers need. An impossible explicit request raises; the default set skips, with a note.
    """
    requested, options = tuple(requested), options or {}
    explicit = bool(requested)
    wanted = requested if explicit else (*registry.available(), *(peers.BATCH_PEERS if batched else peers.PEERS))
    names = [BASELINE] + [n for n in dict.fromkeys(wanted) if n != BASELINE]
    parsed = [(name, *split(name)) for name in names]
    unknown = sorted(set(options) - {base for _, base, _ in parsed})
    if unknown:
        raise ValueError(f"options given for strategies that do not run: {', '.join(unknown)}")
    methods, notes = [], []
    for name, base, settings in parsed:
        method = _construct(name, base, settings, options.get(base))
        if method.is_peer and peers.unavailable(base):
            notes.append(f"{name}: not available ({peers.unavailable(base)})")
            continue
        if method.is_peer and method.peer.engine == "llamacpp" and not batch_conflict(method, batched):
            if why := llamacpp_build.missing(llamacpp_dir):
                raise ValueError(f"{name}: {why}")
        if why := batch_conflict(method, batched):
            if explicit:
                raise ValueError(f"{name}: {why}")
            notes.append(f"{name}: skipped ({why})")
            continue
        try:
            check_request(method.declared, has_draft=has_draft and method.takes_draft)
        except ValueError as error:
            if explicit:
                raise
            notes.append(f"{name}: skipped ({error})")
            continue
        methods.append(method)
    if has_draft and not any(m.takes_draft for m in methods):
        notes.append("the draft model is not used: none of these methods takes one")
    return methods, notes


def check_loaded(
    methods: list[Method], lm: decoders.LM, draft: decoders.LM | None, explicit: bool, notes: list[str]
) -> list[Method]:
    """The methods the loaded models can serve (`decoders.capabilities.check_models`: a draft of the target's
    vocabulary, tree masks), probed once before any run. An explicit request with an unusable method raises, as does
    a draft that no method can use; the default set skips the others, with a note."""
    usable, reasons = [], []
    for method in methods:
        try:
            check_models(method.declared, lm, draft if method.takes_draft else None)
        except (ValueError, TypeError) as error:
            if explicit:
                raise type(error)(f"{method.name}: {error}") from None
            reasons.append(f"{method.name}: {error}")
            notes.append(f"{method.name}: skipped ({error})")
            continue
        usable.append(method)
    if draft is not None and any(m.takes_draft for m in methods) and not any(m.takes_draft for m in usable):
        raise ValueError(f"no method can use the draft model {draft.name!r}: {reasons[0]}")
    return usable
