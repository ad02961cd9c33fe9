"""What `auto` drafts with: a model or its int8 copy, where a measured one-token call shows the copy pays."""

from __future__ import annotations

import warnings

from decoders.drafting.cost import CallCost, call_cost
from decoders.models.device import free_memory
from decoders.models.held import shared
from decoders.models.lm import LM
from decoders.models.quantize import drop_self_draft, int8_bytes, self_draft

CHEAPER = 0.8  # the most a draft's int8 copy's one-token call may cost, as a share of the draft's
SELF = 0.7  # the same for the target's own copy (no draft model)
MEMORY = 0.5  # the most of the device's free memory a copy may take


def drafting_model(
    lm: LM, draft: LM | None, context: int, draft_int8: bool | None = None, self_int8: bool | None = None
) -> LM | None:
    """What auto drafts with: `draft` or its int8 copy, else the target's own int8 copy or None (`int8_copy`)."""
    if draft is not None:
        return int8_copy(draft, draft_int8, context, "draft", CHEAPER) or draft
    return int8_copy(lm, self_int8, context, "target", SELF)


def int8_copy(model: LM, int8: bool | None, context: int, role: str, bar: float) -> LM | None:
    """`model`'s int8 copy where `int8` is True or, if None, where it fits MEMORY and `pays` by `bar`; else None."""
    if int8 is False or model.quantized_from is not None:
        return None
    verdicts = shared(model.model).int8_pays  # decided once per torch module and role
    if int8 is None and role not in verdicts:
        free = free_memory(model.device)
        verdicts[role] = (free is None or int8_bytes(model) <= MEMORY * free) and pays(model, role, context, bar)
        if not verdicts[role]:
            drop_self_draft(model, "int8")
    return self_draft(model, "int8") if int8 or verdicts[role] else None


def pays(model: LM, role: str, context: int, bar: float) -> bool:
    """Whether `model`'s int8 copy (made here) is `cheaper`; a model that cannot be copied drafts as it is."""
    try:
        copy = self_draft(model, "int8")
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as error:
        warnings.warn(
            f"auto drafts with {model.name!r} as it is: its int8 copy could not be made ({error})", stacklevel=4
        )
        return False
    return cheaper(call_cost(copy, "draft"), call_cost(model, role), context, bar)


def cheaper(copy: CallCost, original: CallCost, context: int, bar: float) -> bool:
    """Whether a one-token call of `copy` after `context` tokens costs at most `bar` of one of `original`."""
    return copy.predict(1, context) <= bar * original.predict(1, context)
