"""The losslessness check: every greedy-mode run must reproduce `greedy`'s tokens exactly, token for token.

The full token lists are compared, never truncated: a run that stops early or runs on is a divergence at the first
position where one list has a token and the other has none (or a different one).

At a divergence at position p the target is rerun on prompt + greedy tokens [:p] in one forward pass and the last
logits are read:

    margin = top1 - top2                                        (the target's top-2 logit margin at p, reported)
    gap    = |logit[greedy token] - logit[run's token]|         (how far apart the two choices are)
    tolerance(dtype) = REL_TOLERANCE[dtype] * max(1, |top1|)

    REL_TOLERANCE: float32 1e-4, bfloat16 2**-7 (its machine epsilon), float16 2**-10 (its machine epsilon)

The divergence is a **numeric tie** when both lists have a token at p and gap <= tolerance: a rounding difference
between scoring several tokens in one call and one token per call can flip such a near-tie (reported, not a failure).
The one-pass logits are themselves one rounding of that position among several; when their gap is beyond the
tolerance, the position is scored again the way greedy scored it (prompt prefill, then one cached token per call),
and a gap within the tolerance there is a numeric tie too (in bfloat16 the two ways differ by a few units in the last
place: greedy may have seen an exact tie that the one-pass logits split).
Anything else - a gap beyond the tolerance both ways, or a length difference - is a **failure**: the strategy is not
lossless.

Grammar peers (`outlines:json`) may spell the same JSON with other tokens than the tokenizer's own, so token equality
is not asked of them: their output is **valid** when it parses and satisfies the prompt's schema, else a failure.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence

import jsonschema
import torch

import decoders
import grammars

REL_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def tolerance(dtype: torch.dtype, top1: float) -> float:
    """The largest logit gap counted as a numeric tie for `dtype`, at a top logit of `top1`."""
    rel = REL_TOLERANCE.get(dtype, max(1e-4, torch.finfo(dtype).eps if dtype.is_floating_point else 1e-4))
    return rel * max(1.0, abs(top1))


def first_divergence(reference: Sequence[int], candidate: Sequence[int]) -> int | None:
    """The first position where the two token lists differ (a length difference counts), or None if equal."""
    for position, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return position
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def margin_at(lm: decoders.LM, prompt: Sequence[int], reference: Sequence[int], position: int) -> torch.Tensor:
    """The target's logits [vocab] for position `position` of the reference, from one uncached forward pass."""
    with torch.inference_mode():
        return lm.forward(list(prompt) + list(reference[:position]), lm.new_cache())[-1].float()


def incremental_logits(lm: decoders.LM, prompt: Sequence[int], reference: Sequence[int], position: int) -> torch.Tensor:
    """The target's logits [vocab] for position `position` of the reference, computed as greedy did: the prompt in one
    call, then one cached token per call."""
    with torch.inference_mode():
        cache = lm.new_cache()
        logits = lm.forward(list(prompt), cache, keep=1)
        for token in reference[:position]:
            logits = lm.forward([token], cache)
        return logits[-1].float()


def verdict(lm: decoders.LM, prompt: Sequence[int], reference: Sequence[int], candidate: Sequence[int]) -> dict:
    """Compare a run's tokens with greedy's: {"status": "exact" | "tie" | "failed", "position", "margin", ...}."""
    position = first_divergence(reference, candidate)
    if position is None:
        return {"status": "exact", "position": None}
    if position >= len(reference) or position >= len(candidate):
        longer = "run" if len(candidate) > len(reference) else "greedy"
        return {"status": "failed", "position": position, "margin": None, "gap": None, "tolerance": None,
                "reason": f"length differs ({len(candidate)} tokens vs greedy's {len(reference)}; {longer} goes on)"}
    logits = margin_at(lm, prompt, reference, position)  # [vocab]
    top = torch.topk(logits, 2).values
    expected, got = int(reference[position]), int(candidate[position])
    gap = abs(float(logits[expected] - logits[got]))
    limit = tolerance(lm.dtype, float(top[0]))
    tie, greedy_gap = gap <= limit, None  # greedy_gap: the gap in greedy's own scoring, when the one-pass gap is wide
    if not tie:
        again = incremental_logits(lm, prompt, reference, position)  # [vocab]
        greedy_gap = abs(float(again[expected] - again[got]))
        tie = greedy_gap <= tolerance(lm.dtype, float(again.max()))
    return {
        "status": "tie" if tie else "failed",
        "position": position,
        "margin": float(top[0] - top[1]),
        "gap": gap,
        "greedy_gap": greedy_gap,
        "tolerance": limit,
        "expected_token": expected,
        "got_token": got,
        "reason": ("numeric tie" if gap <= limit else "numeric tie in greedy's own scoring") if tie
        else "different token",
    }


def validity(lm: decoders.LM, run, schema: dict | bool, constraint) -> dict:
    """A grammar peer's run: {"status": "valid"} when its output is JSON satisfying `schema`; an output cut off by
    max_new_tokens is valid when every token keeps it a prefix of some valid output (checked with `constraint`, a
    `grammars.JsonSchema`, under any tokenization). Anything else is a failure, with the reason."""
    text = "".join(run.pieces)
    if run.finish_reason == "length":
        loose = dataclasses.replace(constraint, canonical=False)  # any tokenization of the same language
        try:
            loose.matcher(lm).advance([t for t in run.tokens if t not in lm.eos_token_ids])
        except grammars.GrammarError as error:
            reason = f"cut off at max_new_tokens, and not a prefix of a valid output: {error}"
        else:
            return {"status": "valid", "position": None, "complete": False}
    else:
        try:
            jsonschema.validate(json.loads(text), schema)
        except json.JSONDecodeError as error:
            reason = f"output is not JSON ({error.msg} at character {error.pos})"
        except jsonschema.ValidationError as error:
            reason = f"output violates the schema: {error.message}"
        else:
            return {"status": "valid", "position": None, "complete": True}
    return {"status": "failed", "position": None, "margin": None, "gap": None, "tolerance": None, "reason": reason}


def check(
    lm: decoders.LM,
    runs: list,
    prompts: dict[str, list[int]],
    reference: Callable[[str, bool], list[int]],
    schemas: Mapping[str, tuple[dict, object]] | None = None,
) -> None:
    """Fill `run.lossless` for every run: the baseline's first repeat is the reference, everything else is checked.

    `prompts` maps a prompt id to its tokens; `reference(prompt_id, grammar)` returns greedy's tokens for it (under
    the prompt's grammar when `grammar`); `schemas` maps a prompt id to (schema, its `grammars.JsonSchema`), for the
    grammar peers' validity.
    """
    for run in runs:
        if run.strategy == "greedy" and run.repeat == 0 and not run.grammar:
            run.lossless = {"status": "reference", "position": None}
            continue
        if run.kind == "peer" and run.grammar:
            run.lossless = validity(lm, run, *(schemas or {})[run.prompt_id])
            continue
        expected = reference(run.prompt_id, run.grammar)
        run.lossless = verdict(lm, prompts[run.prompt_id], expected, run.tokens)
