"""Methods: one parser for STRATEGY@KEY=VALUE, each strategy built once, its needs checked before any run."""

from __future__ import annotations

import copy

import pytest

import decoders
from conftest import tiny_lm
from evals.methods import build, check_loaded, option_pairs, plan, split


def names(methods) -> list[str]:
    return [m.name for m in methods]


def test_one_parser_for_settings_and_options():
    assert split("staged@max_depth=12@min_prob=0.05") == ("staged", {"max_depth": 12, "min_prob": 0.05})
    assert split("hf:greedy") == ("hf:greedy", {})
    assert split("x@name=abc@on=true") == ("x", {"name": "abc", "on": True})
    assert split("auto@draft_trees=False@store=None") == ("auto", {"draft_trees": False, "store": None})
    with pytest.raises(ValueError, match="STRATEGY@KEY=VALUE"):
        split("prompt_lookup@k")
    assert option_pairs(["k=4", "name=abc"], scoped=False) == {"k": 4, "name": "abc"}
    assert option_pairs(["speculative.k=4", "staged.max_depth=8"], scoped=True) == {
        "speculative": {"k": 4}, "staged": {"max_depth": 8}}
    with pytest.raises(ValueError, match="STRATEGY.KEY=VALUE"):
        option_pairs(["k=4"], scoped=True)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        option_pairs(["k"], scoped=False)


def test_a_method_is_built_once_with_its_settings_over_the_options():
    method = build("prompt_lookup@k=3", {"k": 2, "max_ngram": 2})
    assert (method.name, method.base, dict(method.options)) == ("prompt_lookup@k=3", "prompt_lookup",
                                                                 {"k": 3, "max_ngram": 2})
    assert method.decoder.options.k == 3 and method.decoder.options.max_ngram == 2 and not method.is_peer
    assert not (method.needs_draft or method.takes_draft or method.needs_grammar)
    assistant = build("hf:assisted")
    assert assistant.is_peer and assistant.decoder is None and assistant.needs_draft and assistant.takes_draft
    assert build("guided").needs_grammar and build("outlines:json").needs_grammar
    assert build("speculative").takes_draft and not build("greedy").takes_draft
    with pytest.raises(ValueError, match="peers take no options"):
        build("hf:greedy@k=1")
    with pytest.raises(TypeError, match="unknown option"):
        build("prompt_lookup", {"kk": 1})


def test_options_for_a_strategy_that_does_not_run_are_refused():
    with pytest.raises(ValueError, match="options given for strategies that do not run: speculative"):
        plan(("prompt_lookup",), has_draft=False, options={"speculative": {"k": 4}})
    with pytest.raises(ValueError, match="k must be"):  # -o options reach the strategy before any model loads
        plan(("prompt_lookup",), has_draft=False, options={"prompt_lookup": {"k": 0}})


def test_a_draft_no_method_takes_is_noted_and_a_draft_free_strategy_is_never_given_one():
    methods, notes = plan(("greedy", "prompt_lookup"), has_draft=True)
    assert names(methods) == ["greedy", "prompt_lookup"]
    assert any("draft model is not used" in n for n in notes)
    methods, notes = plan(("speculative",), has_draft=True)
    assert [m.takes_draft for m in methods] == [False, True] and not notes


def test_a_draft_of_another_vocabulary_is_refused_once_models_load():
    lm = tiny_lm("llama")
    tokenizer = copy.deepcopy(lm.tokenizer)
    tokenizer.add_tokens(["zzqx"])
    stranger = decoders.wrap(lm.model, tokenizer, name="stranger")
    methods, _ = plan(("staged",), has_draft=True)
    with pytest.raises(ValueError, match="staged: draft model 'stranger' does not share the tokenizer"):
        check_loaded(methods, lm, stranger, explicit=True, notes=[])
    methods, _ = plan(("speculative", "threshold", "hf:assisted"), has_draft=True)
    assert names(check_loaded(methods, lm, stranger, explicit=True, notes=[])) == names(methods)
    methods, _ = plan((), has_draft=True)  # the default set: all but staged can use that draft
    notes: list[str] = []
    usable = check_loaded(methods, lm, stranger, explicit=False, notes=notes)
    assert names(usable) == [n for n in names(methods) if n != "staged"]
    assert any(n.startswith("staged: skipped") for n in notes)
    assert names(check_loaded(methods, lm, tiny_lm("llama", seed=1), explicit=False, notes=[])) == names(methods)


def test_a_model_without_tree_masks_stops_an_explicit_tree_strategy_and_skips_it_by_default(monkeypatch):
    def no_trees(self):
        raise TypeError(f"{type(self.model).__name__} cannot score a token tree in one call")

    monkeypatch.setattr(decoders.LM, "check_tree_mask", no_trees)
    lm = tiny_lm("llama")
    methods, _ = plan(("prompt_lookup", "lookahead"), has_draft=False)
    with pytest.raises(TypeError, match="lookahead: LlamaForCausalLM cannot score a token tree"):
        check_loaded(methods, lm, None, explicit=True, notes=[])
    methods, _ = plan((), has_draft=False)
    notes: list[str] = []
    usable = check_loaded(methods, lm, None, explicit=False, notes=notes)
    tree = [m.name for m in methods if m.declared.needs_tree_mask]
    assert tree and not set(tree) & set(names(usable)) and len(usable) == len(methods) - len(tree)
    assert all(any(n.startswith(f"{name}: skipped") for n in notes) for name in tree)
