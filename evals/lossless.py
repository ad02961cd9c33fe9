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
Anything else - a gap beyond the tolerance, or a length difference - is a **failure**: the strategy is not lossless.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import decoders

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
    return {
        "status": "tie" if gap <= limit else "failed",
        "position": position,
        "margin": float(top[0] - top[1]),
        "gap": gap,
        "tolerance": limit,
        "expected_token": expected,
        "got_token": got,
        "reason": "numeric tie" if gap <= limit else "different token",
    }


def check(
    lm: decoders.LM,
    runs: list,
    prompts: dict[str, list[int]],
    reference: Callable[[str, bool], list[int]],
) -> None:
    """Fill `run.lossless` for every run: the baseline's first repeat is the reference, everything else is checked.

    `prompts` maps a prompt id to its tokens; `reference(prompt_id, grammar)` returns greedy's tokens for it (under
    the prompt's grammar when `grammar`).
    """
    for run in runs:
        if run.strategy == "greedy" and run.repeat == 0 and not run.grammar:
            run.lossless = {"status": "reference", "position": None}
            continue
        expected = reference(run.prompt_id, run.grammar)
        run.lossless = verdict(lm, prompts[run.prompt_id], expected, run.tokens)
