"""`generate` and `stream`: check the request once, then run a strategy step by step until the run finishes."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Sequence
from numbers import Integral

from decoders import batch, registry
from decoders.base import Chunk, Decoder, DecodeState, Result
from decoders.capabilities import check_models, check_request
from decoders.decoding import Decoding
from decoders.models.lm import LM
from decoders.models.loading import load
from decoders.models.quantize import self_draft
from decoders.options import whole
from samplers import SamplingConfig, make_generator

Prompt = str | Sequence[int]


BATCH_SIZE = 8  # even on a 2-core CPU a call of 8 rows costs little more than one row's


def stream(lm: LM, prompt: Prompt | Sequence[Prompt], **kwargs) -> Iterator[Chunk]:
    """Run a strategy and yield the tokens of each step as they are accepted (same arguments as `generate`); with a
    list of prompts each chunk carries its prompt's `index`."""
    if is_batch(prompt):
        for _, chunk, _ in _run_batch(lm, prompt, with_text=True, **kwargs):
            yield chunk
        return
    yield from prepare(lm, prompt, **kwargs).chunks()


def generate(lm: LM, prompt: Prompt | Sequence[Prompt], **kwargs) -> Result | list[Result]:
    """Decode `prompt` with a strategy; returns the new text, tokens, their sources and the run's stats.

    Args:
        lm: the target model (`decoders.load` or `decoders.wrap`).
        prompt: text or token ids, or a list of those decoded together (`decoders.batch`) into a list of `Result`s;
            a row whose strategy raises ends with finish_reason "error" (`result.error`), the others go on.
        batch_size: with a list of prompts, the most rows in flight (default BATCH_SIZE); 1: each alone.
        strategy: a registered name (`decoders.available()`) or a `Decoder` instance. Default "greedy".
        max_new_tokens: the most tokens to add (> 0). Default 128.
        draft: an `LM`, a name for `decoders.load`, or "self:int8" (the target's own int8 copy).
        temperature, top_k, top_p, min_p: sampling settings; temperature 0 (the default) is greedy.
        seed: the sampling seed; with a list of prompts an int s seeds row i with s + i, a list each row.
        grammar: a `grammars` constraint; with a list of prompts, one for all or one per prompt (or None).
        stop: stop strings (EOS always stops); with a list of prompts, one string or list for all, or one entry per
            prompt (None or a list of strings).
        **options: the strategy's options (e.g. k=5).
    """
    if is_batch(prompt):
        results: list[Result | None] = [None] * len(prompt)
        for index, _, result in _run_batch(lm, prompt, with_text=False, **kwargs):
            if result is not None:
                results[index] = result
        return results
    run = prepare(lm, prompt, **kwargs)
    for _ in run.chunks(with_text=False):
        pass
    return run.result()


def prepare(lm: LM, prompt: Prompt, **kwargs) -> Decoding:
    """Check a request (same arguments as `generate`) and build its run, without running it."""
    return Decoding(*_prepare(lm, prompt, **kwargs))


def _prepare(
    lm: LM,
    prompt: Prompt,
    strategy: str | Decoder = "greedy",
    max_new_tokens: int = 128,
    draft: LM | str | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    grammar=None,
    stop: str | Sequence[str] | None = None,
    **options,
) -> tuple[DecodeState, Decoder]:
    """Validate every argument up front and build the run's state."""
    decoder, max_new_tokens = _settings(lm, strategy, max_new_tokens, options)
    if seed is not None:
        seed = whole("seed", seed, 0, 2**64)  # what a torch.Generator takes
    tokens = _prompt_tokens(lm, prompt)
    if lm.context_length is not None and len(tokens) + max_new_tokens > lm.context_length:
        raise ValueError(
            f"the prompt ({len(tokens)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's context "
            f"of {lm.context_length} tokens; shorten the prompt or lower max_new_tokens"
        )
    matcher = None
    if grammar is not None:
        if not callable(getattr(grammar, "matcher", None)):
            raise TypeError(
                "grammar= takes a grammars constraint (grammars.json_schema, grammars.regex, grammars.choice, "
                f"grammars.cfg), got {type(grammar).__name__}"
            )
        matcher = grammar.matcher(lm)  # built once per tokenizer and constraint, then cached
    sampling = SamplingConfig(temperature, top_k, top_p, min_p)
    check_request(decoder, has_draft=draft is not None, has_grammar=grammar is not None)
    draft = resolve_draft(lm, draft)
    check_models(decoder, lm, draft)  # before the clock: probes are cached on the LMs
    many = isinstance(stop, Iterable) and not isinstance(stop, str)
    stops = () if stop is None else tuple(stop) if many else (stop,)
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"stop= takes stop strings: a non-empty string or a list of them, got {stop!r}")
    state = DecodeState(
        lm=lm,
        tokens=tokens,
        prompt_len=len(tokens),
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        generator=None if sampling.greedy else make_generator(seed, lm.device),
        draft=draft,
        seeded=seed is not None and not sampling.greedy,
        stop=stops,
        grammar=matcher,
    )
    return state, decoder


def _settings(lm: LM, strategy: str | Decoder, max_new_tokens: int, options: dict) -> tuple[Decoder, int]:
    """The checks that need no prompt: the model, the strategy with its options, and max_new_tokens."""
    if not isinstance(lm, LM):
        raise TypeError(f"expected a decoders.LM (from decoders.load or decoders.wrap), got {type(lm).__name__}")
    if isinstance(strategy, Decoder):
        if options:
            raise TypeError("pass strategy options either to the Decoder instance or as keywords, not both")
        decoder = strategy
    else:
        decoder = registry.get(strategy)(**options)
    return decoder, whole("max_new_tokens", max_new_tokens)


def is_batch(prompt) -> bool:
    """Whether `prompt` is a list of prompts (strings or sequences of ids), not one prompt; [] is a list of none."""
    return isinstance(prompt, list | tuple) and all(
        isinstance(p, str) or (isinstance(p, Iterable) and not isinstance(p, bytes)) for p in prompt
    )


def _per_row(value, count: int, name: str, rows: bool) -> list:
    """`value` for each of `count` prompts: `value` itself, or its items where `rows` says it has one per prompt."""
    if not rows:
        return [value] * count
    if len(value) != count:
        raise ValueError(f"{name}= has {len(value)} entries for {count} prompts: give one for all, or one per prompt")
    return list(value)


def _run_batch(
    lm: LM,
    prompts: Sequence[Prompt],
    batch_size: int = BATCH_SIZE,
    seed=None,
    grammar=None,
    stop=None,
    with_text: bool = True,
    **kwargs,
):
    """Check every prompt (an error names its index) before any runs, then decode them batched (`decoders.batch`).
    No prompts: nothing runs, but what needs no prompt is checked."""
    batch_size = whole("batch_size", batch_size)
    if not prompts:
        request = inspect.signature(_prepare).bind(lm, None, **kwargs)
        request.apply_defaults()
        _settings(lm, *(request.arguments[name] for name in ("strategy", "max_new_tokens", "options")))
        return
    many = isinstance(seed, list | tuple)
    seeds = _per_row(seed, len(prompts), "seed", many)
    if not many and seed is not None:
        seeds = [whole("seed", seed, 0, 2**64 - len(prompts)) + i for i in range(len(prompts))]
    grammars = _per_row(grammar, len(prompts), "grammar", isinstance(grammar, list | tuple))
    per_row_stop = (
        isinstance(stop, list | tuple)
        and len(stop) > 0
        and all(  # an empty list: no stop strings
            s is None or isinstance(s, list | tuple) for s in stop
        )
    )
    stops = _per_row(stop, len(prompts), "stop", per_row_stop)
    runs = []
    for i, prompt in enumerate(prompts):
        try:
            runs.append(prepare(lm, prompt, seed=seeds[i], grammar=grammars[i], stop=stops[i], **kwargs))
        except (TypeError, ValueError) as error:
            raise type(error)(f"prompt {i}: {error}") from None
    yield from batch.run(lm, runs, batch_size, with_text)


def resolve_draft(lm: LM, draft: LM | str | None) -> LM | None:
    """The draft: an `LM`, "self:int8" (the target's own int8 copy, kept on it), or a name to load like the target."""
    if draft is None or isinstance(draft, LM):
        return draft
    if not isinstance(draft, str):
        raise TypeError(f"draft= takes a decoders.LM, a model name or 'self:int8', got {type(draft).__name__}")
    if draft.startswith("self:"):
        return self_draft(lm, draft.removeprefix("self:"))
    return load(draft, dtype=lm.dtype, device=lm.device)


def _prompt_tokens(lm: LM, prompt: Prompt) -> list[int]:
    """The prompt as token ids: text, or one sequence of ids (a list, an array, a [T] or [1, T] tensor; not a batch)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty; give some text or token ids to continue")
        tokens = lm.encode(prompt)
    elif not isinstance(prompt, Iterable):
        raise TypeError(f"prompt must be a string or a list of token ids, got {prompt!r}")
    else:
        shape = tuple(getattr(prompt, "shape", ()))
        if len(shape) > 2 or (len(shape) == 2 and shape[0] != 1):
            raise ValueError(
                f"got a batch of prompts (shape {list(shape)}): pass one sequence of token ids, or a list "
                "of prompts to decode them together"
            )
        tokens = prompt.reshape(-1).tolist() if shape else list(prompt)
        if any(isinstance(t, (list, tuple)) or getattr(t, "ndim", 0) for t in tokens):
            raise ValueError(
                "got a nested sequence inside one prompt; a list of prompts is a list of strings or of token-id lists"
            )
    if not tokens:
        raise ValueError("the prompt is empty; give some text or token ids to continue")
    bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < lm.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {lm.vocab_size}); got {bad[:5]}")
    return [int(t) for t in tokens]
