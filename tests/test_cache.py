"""KVCache rollback: after crop / keep, the model continues exactly as if the dropped positions were never seen."""

import torch

from conftest import PROMPTS, tiny_lm


def fresh_logits(lm, tokens):
    return lm.forward(tokens, lm.new_cache())[-1]


def test_crop_then_continue_matches_fresh(arch):
    lm = tiny_lm(arch)
    ids = lm.encode(PROMPTS[0])
    with torch.inference_mode():
        cache = lm.new_cache()
        lm.forward(ids + [5, 6, 7, 8], cache)  # speculative positions that get rejected
        assert len(cache) == len(ids) + 4
        cache.crop(len(ids))
        assert len(cache) == len(ids)
        logits = lm.forward([9], cache)[-1]
        torch.testing.assert_close(logits, fresh_logits(lm, ids + [9]), rtol=1e-4, atol=1e-4)


def test_keep_a_tree_path_then_continue_matches_fresh(arch):
    """Score two branches side by side with a tree mask, keep one, continue: same as the path alone."""
    lm = tiny_lm(arch)
    ids = lm.encode(PROMPTS[1])
    # nodes: 0=a (root child), 1=b (sibling of a), 2=c (child of a); keep path a -> c
    tree = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
    positions = [len(ids), len(ids), len(ids) + 1]
    with torch.inference_mode():
        cache = lm.new_cache()
        lm.forward(ids, cache)
        lm.forward([11, 12, 13], cache, positions=positions, tree_mask=tree)
        cache.keep(list(range(len(ids))) + [len(ids), len(ids) + 2])
        assert len(cache) == len(ids) + 2
        logits = lm.forward([14], cache)[-1]
        torch.testing.assert_close(logits, fresh_logits(lm, ids + [11, 13, 14]), rtol=1e-4, atol=1e-4)


def test_crop_and_keep_reject_bad_arguments():
    import pytest

    lm = tiny_lm("llama")
    with torch.inference_mode():
        cache = lm.new_cache()
        lm.forward([1, 2, 3], cache)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(4)
    with pytest.raises(ValueError, match="increasing"):
        cache.keep([2, 1])
    with pytest.raises(ValueError, match="must lie in"):
        cache.keep([0, 3])


def test_every_tiny_architecture_takes_a_tree_mask(arch):
    """Records which architectures the installed transformers lets score a tree in one call (all of these do)."""
    tiny_lm(arch).check_tree_mask()


def test_a_model_that_ignores_the_mask_gets_a_clear_error(monkeypatch):
    import pytest

    from decoders.models import lm as lm_module

    lm = lm_module.wrap(tiny_lm("llama").model, tiny_lm("llama").tokenizer)
    lm.native = None  # (transformers' calls: the native step builds its own masks)
    monkeypatch.setattr(lm_module.LM, "_tree_attention_mask", lambda self, tree, positions, past: None)
    with pytest.raises(TypeError, match="LlamaForCausalLM cannot score a token tree"):
        lm.check_tree_mask()
