"""The tree-mask probe tests the mask, not the kernels' rounding: an int8 draft whose kernels change with the call size
passes it, a model that ignores the mask does not, and the error names the model and its part in the run."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, PROMPTS, tiny_model, tiny_tokenizer

import decoders
from decoders.models import int8 as int8_module
from evals.methods import check_loaded, plan


def _ignores_the_mask(lm: decoders.LM) -> decoders.LM:
    lm.native = None  # (transformers' calls, whose masks this breaks: the native step builds its own)
    lm._tree_attention_mask = lambda tree, positions, past: None  # every tree call runs causally
    return lm


@pytest.mark.parametrize("draft_kind", ["self:int8", "quantize"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_staged_takes_an_int8_draft_whose_kernels_change_with_the_call_size(arch, draft_kind, monkeypatch):
    """Calls of 4 rows or more run on the float weights (`float_from`), shorter ones on the int8 weights: the probe's
    3-node tree call and longer calls round apart, as the int8 copy of SmolLM2 did."""
    monkeypatch.setattr(int8_module, "_float_from", lambda layer, weight: 4)
    lm = decoders.wrap(tiny_model(arch), tiny_tokenizer(), name=f"tiny-{arch}")  # a fresh module: no kept copy
    draft = "self:int8" if draft_kind == "self:int8" else decoders.quantize(lm)
    greedy = decoders.generate(lm, PROMPTS[0], strategy="greedy", max_new_tokens=20)
    staged = decoders.generate(lm, PROMPTS[0], strategy="staged", draft=draft, max_new_tokens=20)
    assert staged.tokens == greedy.tokens


def test_noise_that_depends_on_the_call_size_is_not_taken_for_an_ignored_mask():
    lm = decoders.wrap(tiny_model("llama"), tiny_tokenizer())
    honest = lm.forward

    def noisy(tokens, cache, **options):  # the mask honoured, then rounding of 0.1 that changes with the call size
        logits = honest(tokens, cache, **options)
        return logits + 0.1 * torch.sin(1e3 * len(tokens) * logits)

    lm.forward = noisy
    lm.check_tree_mask()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_an_ignored_mask_is_still_caught(arch, dtype):
    lm = _ignores_the_mask(decoders.wrap(tiny_model(arch, dtype=dtype), tiny_tokenizer()))
    with pytest.raises(TypeError, match="ignores a custom attention mask"):
        lm.check_tree_mask()


@pytest.mark.parametrize("role", ["target", "draft"])
def test_the_error_names_the_model_class_and_whether_the_target_or_the_draft_failed(role):
    target = decoders.wrap(tiny_model("llama"), tiny_tokenizer(), name="tiny-target")
    draft = decoders.wrap(tiny_model("qwen2", seed=1), tiny_tokenizer(), name="tiny-draft")
    failing = _ignores_the_mask(target if role == "target" else draft)
    message = (f"{role} model '{failing.name}': {type(failing.model).__name__} cannot score a token tree in one call "
               r"\(it ignores a custom attention mask\)")
    with pytest.raises(TypeError, match=message):
        decoders.generate(target, PROMPTS[0], strategy="staged", draft=draft, max_new_tokens=5)
    methods, _ = plan(("greedy", "staged"), has_draft=True)  # `decodekit compare` checks the models so
    with pytest.raises(TypeError, match=f"staged: {message}"):
        check_loaded(methods, target, draft, explicit=True, notes=[])
