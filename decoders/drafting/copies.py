"""What `auto` drafts with: the draft model as given or its own int8 copy, and without a draft model the target's own
int8 copy or nothing, each as a measured one-token call finds it pays (`drafting_model`).

An int8 copy (`decoders.quantize`) reads about half the bytes of bfloat16 weights per call, so where a call is bound by
reading the weights (one token on a CPU) it costs about half as much; where it is not (a GPU, say) it may cost as much
or more. So the copy is measured, not assumed: once per model and role, from the cached calibration of both
(`decoders.drafting.cost.call_cost`).
"""

from __future__ import annotations

import warnings

from decoders.drafting.cost import CallCost, call_cost
from decoders.models.lm import LM, free_memory
from decoders.models.quantize import int8_bytes


CHEAPER = 0.8  # auto drafts with the draft model's own int8 copy where the copy's one-token call is measured at most
# this share of the original's (`int8_copy`): the copy's tokens are nearly the original's (`threshold` with the 0.5B's
# int8 copy and with the 0.5B in bfloat16 drafting for the 1.5B took the same target calls within one on each of
# seven prompts, AMD EPYC), so its cheaper calls are what it brings; the margin covers the acceptance it may lose
SELF = 0.7  # without a draft model, auto drafts with the target's own int8 copy where the copy's one-token call is
# measured at most this share of the target's: 0.49 for the 1.5B in bfloat16 on the AMD EPYC, where `auto` with it
# ran bench 2.01 / 2.71 / 1.73x greedy against 1.22 / 2.13 / 1.12x without it (one run), 0.28-0.36 for SmolLM2-135M
# in float32 there (seven prompts 1.4-3.4x, without it 1.0-3.6x), and 0.51 for the 1.5B on the Intel Xeon with AMX
# (`auto` with `draft="self:int8"` 1.51x overall there). It was 0.6 until the Intel Xeon without AMX measured the
# 1.5B's copy at 0.60-0.65 (just over, most calibrations): there, two interleaved repeats of bench took 132.9 s with
# the copy (`auto@self_int8=True`, 63 target calls) against 174.2 s without (247), and SmolLM2's seven prompts 54.7 s
# against 54.9 (the chooser still drafts with the copy only where its chain pays)
MEMORY = 0.5  # and where the copy takes at most this share of the memory free on the model's device


INT8_PAYS = "_decodekit_int8_pays"  # the torch module's attribute holding role -> whether its int8 copy pays
# (`int8_copy`): on the module, so that a copy found too dear is not made again for each run, nor for each LM wrapping
# the module (transformers' `model.generate` wraps it anew in each call)


def drafting_model(lm: LM, draft: LM | None, context: int, draft_int8: bool | None = None,
                   self_int8: bool | None = None) -> LM | None:
    """What auto drafts with for the target `lm` after `context` tokens: the draft model (`draft`) or its int8 copy
    (`draft_int8`), or without one the target's own int8 copy (`self_int8`) or nothing, as `int8_copy` finds they
    pay where the flag is None (`AutoOptions`)."""
    if draft is not None:
        return int8_copy(draft, draft_int8, context, "draft", CHEAPER) or draft
    return int8_copy(lm, self_int8, context, "target", SELF)


def int8_copy(model: LM, int8: bool | None, context: int, role: str, bar: float) -> LM | None:
    """`model`'s own int8 copy to draft with (`LM.self_draft`: made on first use, kept with the model), or None:
    where `int8` is True, or, when None, where a one-token draft call of the copy after `context` tokens is measured
    (`call_cost`, cached per model and device) at most `bar` of a one-token call of `model` in `role` ("draft":
    the run's draft model, "target": the target itself, without a draft) and the copy takes at most MEMORY of the
    memory free on the model's device. Decided once per model and role; a copy found too dear is let go again.

    The copy's linear layers hold int8 weights with one scale per output, its embeddings and norms are the
    original's: where a call reads its weights once (one token on a CPU) it reads half the bytes of bfloat16. On the
    AMD EPYC the 0.5B's copy took 28 ms a call where the 0.5B in bfloat16 took 65, and the 1.5B's 0.48-0.51 of the
    1.5B's call. Making it costs seconds once, in the first run with the model (1.3-1.7 s for the 0.5B there, 2.7-3.9
    s for the 1.5B)."""
    if int8 is False or model.quantized_from is not None:
        return None
    verdicts = vars(model.model).setdefault(INT8_PAYS, {})
    if int8 is None and role not in verdicts:
        free = free_memory(model.device)
        verdicts[role] = (free is None or int8_bytes(model) <= MEMORY * free) and pays(model, role, context, bar)
        if not verdicts[role]:
            model.drop_self_draft("int8")
    return model.self_draft("int8") if int8 or verdicts[role] else None


def pays(model: LM, role: str, context: int, bar: float) -> bool:
    """Whether `model`'s int8 copy is `cheaper` (made here, if need be). A model `decoders.quantize` cannot copy (no
    linear layer it knows, weights already quantized by another library, ...) drafts as it is, with a warning."""
    try:
        copy = model.self_draft("int8")
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as error:
        warnings.warn(f"auto drafts with {model.name!r} as it is: its int8 copy could not be made ({error})",
                      stacklevel=4)
        return False
    return cheaper(call_cost(copy, "draft"), call_cost(model, role), context, bar)


def cheaper(copy: CallCost, original: CallCost, context: int, bar: float) -> bool:
    """Whether a one-token call of `copy` after `context` tokens costs at most `bar` of one of `original`."""
    return copy.predict(1, context) <= bar * original.predict(1, context)
