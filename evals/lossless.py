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

In bfloat16 and float16 a wide gap is not yet evidence of a bug: rounding inside the network (not only of the final
logits) moves a logit gap by a few tolerances from one way of scoring a position to another (smollm2-135m: up to 2.4
tolerances away from float32, over 1000 positions scored five ways). So the position is scored once more by a float32
copy of the same weights (every bfloat16/float16 weight is exact in float32), the exact model up to float32 noise, and
the low-precision verdict is judged by it:

    float32_gap    = |logit32[greedy token] - logit32[run's token]|
    rounding_error = the largest error of the two low-precision scorings above on the gaps between greedy's token and
                     float32's other top NOISE_TOKENS tokens (how far this dtype's rounding moves a gap right here)

float32_gap <= max(tolerance, NOISE_MARGIN * rounding_error) is a numeric tie: in the exact model the two tokens are
closer than the dtype's rounding is seen to move a gap at this very position, so rounding alone can order them either
way (the run's own scoring call is not replayed: NOISE_MARGIN allows it to err twice as far as the two replayed ones).
A token that float32 ranks further from greedy's, on either side, is still a failure - unless the run's own record
shows the target chose it: a decodekit run keeps, per token, how far it fell below the best logit of the target call
that verified or chose it (`Stats.argmax_gaps`). A token that call ranked first, on a gap float32 puts within
CHOSEN_MARGIN x that bound, is a numeric tie: the target's choice, made over cached keys and values that other call
shapes than greedy's rounded (the drift adds up over the earlier positions, which the replayed scorings do not
share). A strategy that keeps a wrong draft token has a gap above 0 in that record and still fails. The copy is made
only when a divergence needs it, at most once per `check`, and dropped when `check` returns.
Anything else - a gap beyond the tolerance every way, or a length difference - is a **failure**: the strategy is not
lossless.

Peers on their own kernels (llama.cpp's `llamacpp:*`, on a GGUF of the same weights) round otherwise than decodekit's
model at every step, so agreement is reported, not required: the share of greedy's tokens they reproduce before a
first difference (`agreement`), status "exact" when all, else "differs" - in float32 a difference the check above
finds a numeric tie is a "tie" instead.

Grammar peers (`outlines:json`) may spell the same JSON with other tokens than the tokenizer's own, so token equality
is not asked of them: their output is **valid** when it parses and satisfies the prompt's schema, else a failure.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
from collections.abc import Callable, Mapping, Sequence

import jsonschema
import torch

import decoders
import grammars
from evals.metrics import BASELINE

REL_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
RECHECKED = (torch.bfloat16, torch.float16)  # dtypes whose wide gaps are judged again in float32
NOISE_TOKENS = 10  # rounding_error is measured on the gaps to this many of float32's top tokens
NOISE_MARGIN = 2.0  # how much further than the two replayed scorings the run's own scoring call may err
CHOSEN_MARGIN = 2.0  # and how much further still when the target itself chose the run's token (its cache drifted)


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


class Scored:
    """The logits `verdict` scores, each computed once per model, prompt, reference prefix and way of scoring: the runs
    of several strategies often leave greedy's output at the same tie, and each scoring is a forward pass over the
    prompt and the reference up to there (on the AVX2-only AMD EPYC, where the 1.5B computes bfloat16 in float, 15-30 s
    each; in the default suite's SmolLM2 report four runs left code-palindrome at the same token)."""

    def __init__(self) -> None:
        self.logits: dict[tuple, torch.Tensor] = {}

    def __call__(
        self, score: Callable, lm: decoders.LM, prompt: Sequence[int], reference: Sequence[int], position: int
    ) -> torch.Tensor:
        """`score(lm, prompt, reference, position)` ([vocab]: `margin_at` or `incremental_logits`), once."""
        key = (score, id(lm), tuple(prompt), tuple(reference[:position]))
        if key not in self.logits:
            self.logits[key] = score(lm, prompt, reference, position)
        return self.logits[key]


def float32_copy(lm: decoders.LM) -> decoders.LM:
    """A float32 copy of `lm`'s model (same weights, same device), wrapped with its tokenizer."""
    # each weight goes straight to its float32 copy: deepcopy finds it in the memo and never copies the original first
    memo = {
        id(p): torch.nn.Parameter(p.detach().float(), requires_grad=False)
        for p in lm.model.parameters()
        if p.is_floating_point()
    }
    model = copy.deepcopy(lm.model, memo).float()  # .float() converts the floating buffers too
    return decoders.wrap(model, lm.tokenizer, name=f"{lm.name} (float32)")


class Float32Model:
    """The float32 copy that judges divergences: made on first use, at most once, dropped by `release` (or `with`)."""

    def __init__(self, lm: decoders.LM) -> None:
        self.lm = lm
        self._copy: decoders.LM | None = None
        self._error: str | None = None  # why the copy could not be made (not retried)

    def get(self) -> decoders.LM:
        """The float32 copy; raises RuntimeError if it cannot be made."""
        if self._copy is None and self._error is None:
            try:
                self._copy = float32_copy(self.lm)
            except Exception as error:  # noqa: BLE001 - an uncopyable model keeps its low-precision verdict
                self._error = f"{type(error).__name__}: {error}"
        if self._copy is None:
            raise RuntimeError(self._error)
        return self._copy

    def release(self) -> None:
        """Drop the copy and give its memory back."""
        if self._copy is not None:
            self._copy = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def __enter__(self) -> Float32Model:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def verdict(
    lm: decoders.LM,
    prompt: Sequence[int],
    reference: Sequence[int],
    candidate: Sequence[int],
    exact: Float32Model | None = None,  # the float32 judge to share across calls; default: one made for this call
    gaps: Sequence[float | None] = (),  # the run's `Stats.argmax_gaps`: 0 where the verifying call chose the token
    scored: Scored | None = None,  # the logits scored so far, to share across calls; default: this call's own
) -> dict:
    """Compare a run's tokens with greedy's: {"status": "exact" | "tie" | "failed", "position", "margin", ...,
    "reason"}, the reason one line a user can read."""
    position = first_divergence(reference, candidate)
    if position is None:
        return {"status": "exact", "position": None}
    if position >= len(reference) or position >= len(candidate):
        longer = "run" if len(candidate) > len(reference) else "greedy"
        return {
            "status": "failed",
            "position": position,
            "margin": None,
            "gap": None,
            "tolerance": None,
            "reason": f"length differs ({len(candidate)} tokens vs greedy's {len(reference)}; {longer} goes on)",
        }
    if exact is None:
        with Float32Model(lm) as exact:
            return verdict(lm, prompt, reference, candidate, exact, gaps, scored)
    scored = scored or Scored()
    name = str(lm.dtype).removeprefix("torch.")
    logits = scored(margin_at, lm, prompt, reference, position)  # [vocab]
    top = torch.topk(logits, 2).values
    expected, got = int(reference[position]), int(candidate[position])
    gap = abs(float(logits[expected] - logits[got]))
    limit = tolerance(lm.dtype, float(top[0]))
    found = {
        "status": "tie",
        "position": position,
        "margin": float(top[0] - top[1]),
        "gap": gap,
        "greedy_gap": None,
        "float32_gap": None,
        "rounding_error": None,
        "tolerance": limit,
        "expected_token": expected,
        "got_token": got,
    }
    if gap <= limit:
        return {**found, "reason": f"numeric tie: {gap:.3g} apart in {name}, within its rounding of {limit:.3g}"}
    again = scored(incremental_logits, lm, prompt, reference, position)  # [vocab], as greedy scored it
    greedy_gap = found["greedy_gap"] = abs(float(again[expected] - again[got]))
    if greedy_gap <= tolerance(lm.dtype, float(again.max())):
        return {
            **found,
            "reason": f"numeric tie: {greedy_gap:.3g} apart in greedy's own {name} scoring, "
            f"within its rounding of {limit:.3g}",
        }
    if lm.dtype not in RECHECKED:
        return {
            **found,
            "status": "failed",
            "reason": f"different token: {greedy_gap:.3g} apart in {name}, beyond its rounding of {limit:.3g}",
        }
    try:
        exact32 = scored(margin_at, exact.get(), prompt, reference, position)  # [vocab]
    except Exception as error:  # noqa: BLE001 - a model float32 cannot copy or run keeps its low-precision verdict
        return {
            **found,
            "status": "failed",
            "reason": f"different token: {greedy_gap:.3g} apart in {name}, beyond "
            f"its rounding of {limit:.3g}; no float32 recheck: {error}",
        }
    lead = float(exact32[expected] - exact32[got])  # > 0: float32 prefers greedy's token too
    noise = found["rounding_error"] = rounding_error((logits, again), exact32, expected, got)
    found["float32_gap"] = abs(lead)
    bound = max(tolerance(lm.dtype, float(exact32.max())), NOISE_MARGIN * noise)
    if abs(lead) <= bound:
        return {
            **found,
            "reason": f"numeric tie: {greedy_gap:.3g} apart in {name}, {abs(lead):.2g} in float32, "
            f"where {name} errs by up to {noise:.2g}",
        }
    chosen = position < len(gaps) and gaps[position] == 0.0
    if chosen and abs(lead) <= CHOSEN_MARGIN * bound:
        return {
            **found,
            "reason": f"numeric tie: the target's own choice in the call that verified it, whose cached "
            f"keys and values were rounded in other calls than greedy's; {abs(lead):.2g} apart "
            f"in float32, within the {CHOSEN_MARGIN * bound:.2g} that {name} drift explains",
        }
    side = "below" if lead > 0 else "above"
    return {
        **found,
        "status": "failed",
        "reason": f"different token: float32 ranks it {abs(lead):.3g} {side} greedy's, beyond the {bound:.2g} "
        f"that {name} rounding explains here",
    }


def agreement(
    lm: decoders.LM,
    prompt: Sequence[int],
    reference: Sequence[int],
    candidate: Sequence[int],
    exact: Float32Model | None = None,
    scored: Scored | None = None,
) -> dict:
    """A run on other kernels than decodekit's (llama.cpp's) against greedy: {"status": "exact" | "tie" | "differs",
    "position", "agreed" (greedy's tokens it reproduced before the first difference), "of" (greedy's tokens), ...}.
    Only in float32, where the two should agree up to ties, is a difference judged (`verdict`); never a failure."""
    position = first_divergence(reference, candidate)
    agreed = {"agreed": len(reference) if position is None else position, "of": len(reference)}
    if position is None:
        return {"status": "exact", "position": None, **agreed}
    share = f"{agreed['agreed']} of greedy's {len(reference)} tokens agree before"
    if lm.dtype == torch.float32 and position < min(len(reference), len(candidate)):
        judged = verdict(lm, prompt, reference, candidate, exact, (), scored)
        if judged["status"] == "tie":
            return {**judged, **agreed}
        return {**judged, **agreed, "status": "differs", "reason": f"{share} it: {judged['reason']}"}
    return {
        "status": "differs",
        "position": position,
        "margin": None,
        "gap": None,
        "tolerance": None,
        **agreed,
        "reason": f"{share} a first difference (its own kernels; agreement is reported, not required)",
    }


def rounding_error(views: Sequence[torch.Tensor], exact: torch.Tensor, expected: int, got: int) -> float:
    """How far low-precision `views` (each [vocab]) move logit gaps from float32's `exact` [vocab] at one position:
    the largest error on the gap between `expected` and any other of the float32 top NOISE_TOKENS tokens (`got` left
    out: the gap being judged must not vouch for itself)."""
    ranked = exact.topk(min(NOISE_TOKENS + 2, len(exact))).indices.tolist()
    top = [t for t in ranked if t not in (expected, got)][:NOISE_TOKENS]
    want = exact[expected] - exact[top]  # [NOISE_TOKENS]
    return max(float(((view[expected] - view[top]) - want).abs().max()) for view in views)


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
    """Fill `run.lossless` for every run: the baseline's first repeat is the reference (in a batched compare, at batch
    size 1), everything else is checked - each request of a batched compare on its own, against greedy at batch 1.

    `prompts` maps a prompt id to its tokens; `reference(prompt_id, grammar)` returns greedy's tokens for it (under
    the prompt's grammar when `grammar`); `schemas` maps a prompt id to (schema, its `grammars.JsonSchema`), for the
    grammar peers' validity.
    """
    scored = Scored()  # (runs that leave greedy's output at the same token share its scoring)
    with Float32Model(lm) as exact:  # made only if a divergence needs it, dropped on return
        for run in runs:
            at_batch_1 = getattr(run, "batch_size", None) in (None, 1)  # (None: a one-prompt compare)
            if run.strategy == BASELINE and run.repeat == 0 and not run.grammar and at_batch_1:
                run.lossless = {"status": "reference", "position": None}
            elif run.kind == "peer" and run.grammar:
                run.lossless = validity(lm, run, *(schemas or {})[run.prompt_id])
            elif run.kind == "peer" and run.strategy.startswith("llamacpp:"):  # other kernels: agreement only
                expected = reference(run.prompt_id, run.grammar)
                run.lossless = agreement(lm, prompts[run.prompt_id], expected, run.tokens, exact, scored)
            else:
                expected = reference(run.prompt_id, run.grammar)
                run.lossless = verdict(
                    lm, prompts[run.prompt_id], expected, run.tokens, exact, getattr(run, "argmax_gaps", ()), scored
                )
