"""What `auto` drafts with: the draft model as given or its own int8 copy, and without a draft model the target's own
int8 copy or nothing, each as a measured one-token call finds it pays (`drafting_model`).

An int8 copy (`decoders.quantize`) reads half the bytes of bfloat16 weights, which pays only where a call is bound by
reading them (one token on a CPU), so it is measured once per model and role (`cost.call_cost`), not assumed. The
evidence for CHEAPER and SELF is in docs/design/evidence.md.
"""

from __future__ import annotations

import warnings

from decoders.drafting.cost import CallCost, call_cost
from decoders.models.lm import LM, free_memory
from decoders.models.quantize import int8_bytes


CHEAPER = 0.8  # auto drafts with the draft model's own int8 copy where its one-token call is measured at most this
# share of the original's: its tokens are nearly the original's, so its cheaper calls are what it brings
SELF = 0.7  # the same share for the target's own int8 copy against the target, where there is no draft model
MEMORY = 0.5  # and where the copy takes at most this share of the memory free on the model's device


INT8_PAYS = "_decodekit_int8_pays"  # the torch module's attribute holding role -> whether its int8 copy pays: on the
# module, so a copy found too dear is not made again per run nor per LM wrapping it (as `model.generate` does)


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
    Making the copy costs seconds, once, in the first run with the model."""
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
