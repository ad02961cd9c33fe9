"""Context-free grammars (`grammars.cfg`, on llguidance): the matcher, valid outputs, equivalence of strategies."""

from __future__ import annotations

import random
import re
import types

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

import decoders
import grammars
from tests.conftest import PROMPTS, tiny_lm

# Nested arithmetic: balanced parentheses make it context-free, not regular. One digit per number, so that even a
# random model has to choose between an operator, a bracket and the end at almost every step.
ARITHMETIC = r"""
start: expr
expr: term (OP term)*
term: DIGIT | "(" expr ")"
OP: "+" | "-" | "*"
DIGIT: /[0-9]/
"""
# Balanced brackets of two kinds (a Dyck language), at least one group.
BRACKETS = r"""
start: group+
group: "(" group* ")" | "[" group* "]"
"""
# A fixed keyword, then the arithmetic: the keyword is forced.
KEYWORD = r"""
start: "The quick brown fox " expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
MAX = 60


class Incomplete(Exception):
    """The text ended where the grammar needs more."""


def parse_arithmetic(text: str) -> None:
    """An independent recursive-descent check of ARITHMETIC: raises `Incomplete` for a proper prefix of a valid text
    and `ValueError` for anything else."""
    position = 0

    def peek() -> str:
        if position == len(text):
            raise Incomplete
        return text[position]

    def expr() -> None:
        nonlocal position
        term()
        while position < len(text) and text[position] in "+-*":
            position += 1
            term()

    def term() -> None:
        nonlocal position
        char = peek()
        if char.isdigit():
            position += 1
        elif char == "(":
            position += 1
            expr()
            if peek() != ")":
                raise ValueError(f"expected ')' at {position} in {text!r}")
            position += 1
        else:
            raise ValueError(f"unexpected {char!r} at {position} in {text!r}")

    expr()
    if position != len(text):
        raise ValueError(f"unexpected {text[position]!r} at {position} in {text!r}")


def parse_brackets(text: str) -> None:
    """An independent check of BRACKETS: raises `Incomplete` for a proper prefix of a valid text and `ValueError` for
    anything else."""
    stack: list[str] = []
    for position, char in enumerate(text):
        if char in "([":
            stack.append(char)
        elif char in ")]" and stack and stack[-1] == "([" [")]".index(char)]:
            stack.pop()
        else:
            raise ValueError(f"unexpected {char!r} at {position} in {text!r}")
    if stack or not text:
        raise Incomplete


def nesting(text: str) -> int:
    """The deepest bracket nesting in `text`."""
    depth = deepest = 0
    for char in text:
        depth += (char in "([") - (char in ")]")
        deepest = max(deepest, depth)
    return deepest


PARSERS = {"arithmetic": (ARITHMETIC, parse_arithmetic), "brackets": (BRACKETS, parse_brackets)}


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


@pytest.fixture(scope="module")
def keyword(lm):
    constraint = grammars.cfg(KEYWORD)
    constraint.matcher(lm)  # compiles and caches the grammar once for the module
    return constraint


def encode(lm, text: str) -> list[int]:
    return lm.tokenizer.encode(text, add_special_tokens=False)


def check_output(result, parse) -> None:
    """The run's text is valid if the run finished, a valid prefix if max_new_tokens cut it off."""
    if result.finish_reason == "eos":
        parse(result.text)
        return
    assert result.finish_reason == "length", result.finish_reason
    try:
        parse(result.text)
    except Incomplete:
        pass


# ---------------------------------------------------------------------------------------------------- constraint


def test_cfg_is_a_small_frozen_constraint():
    constraint = grammars.cfg(ARITHMETIC)
    assert isinstance(constraint, grammars.Cfg) and isinstance(constraint, grammars.Constraint)
    assert constraint == grammars.cfg(ARITHMETIC) and hash(constraint) == hash(grammars.cfg(ARITHMETIC))
    with pytest.raises(AttributeError):
        constraint.grammar = "start: a"
    assert constraint.describe().startswith("cfg('start: expr expr: term")


@pytest.mark.parametrize("text, words", [
    ("start: foo", "unknown name"),
    ('start: "a', "lexer error"),
    ("start: /[/", "unclosed character class"),
    ("", "Empty grammar"),
    ('begin: "a"', "start"),
])
def test_invalid_grammars_raise_with_llguidances_message(text, words):
    with pytest.raises(grammars.GrammarError, match=r"invalid grammar in cfg\(") as caught:
        grammars.cfg(text)
    assert words in str(caught.value)


def test_grammar_must_be_text():
    with pytest.raises(grammars.GrammarError, match="takes the grammar's text"):
        grammars.cfg(None)


def tiny_word_lm():
    """A model-less LM of three tokens, "<eos>", "a" and "b", with a padded logits width of 4."""
    backend = Tokenizer(models.WordLevel({"<eos>": 0, "a": 1, "b": 2}, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    return types.SimpleNamespace(tokenizer=tokenizer, vocab_size=4, eos_token_ids=frozenset({0}))


def test_vocabulary_that_cannot_spell_the_grammar():
    """llguidance cannot read this tokenizer's decoder: the token bytes of `grammars.vocabulary` stand in."""
    small = tiny_word_lm()
    matcher = grammars.cfg('start: ("a" "b")+').matcher(small)
    assert matcher.allowed().tolist() == [False, True, False, False]
    assert matcher.forced() == [1, 2]  # then "a" again or EOS: a choice
    optional = grammars.cfg('start: "a" "b"?').matcher(small)
    assert optional.forced() == [1]  # then "b" or EOS: never forced
    optional.advance([1, 2])
    assert optional.is_complete() and optional.forced() == [] and optional.allowed().tolist() == [True] + [False] * 3
    with pytest.raises(grammars.GrammarError, match="allows no first token in this tokenizer's vocabulary"):
        grammars.cfg('start: "c"').matcher(small)
    dead_end = grammars.cfg('start: "a" "c"').matcher(small)
    assert dead_end.forced() == []  # "a" is the only token, but leads nowhere
    with pytest.raises(grammars.GrammarError, match="no allowed token in this vocabulary after 'a'"):
        dead_end.advance([1])
    assert dead_end.tokens == [] and dead_end.allowed().tolist() == [False, True, False, False]


# ---------------------------------------------------------------------------------------------------- matcher


def test_allowed_mask_covers_the_logits_width(lm):
    mask = grammars.cfg(ARITHMETIC).matcher(lm).allowed()
    assert mask.dtype == torch.bool and mask.shape == (lm.vocab_size,)
    assert lm.vocab_size > len(lm.tokenizer) and not mask[len(lm.tokenizer):].any()
    digits_and_open = {t for t in mask.nonzero().flatten().tolist()}
    assert set(encode(lm, "(")) <= digits_and_open and set(encode(lm, "7")) <= digits_and_open
    assert not digits_and_open & set(lm.eos_token_ids)


def test_eos_allowed_exactly_when_finished(lm):
    matcher = grammars.cfg(r'start: "(" "a"? ")"').matcher(lm)
    eos = next(iter(lm.eos_token_ids))
    matcher.advance(encode(lm, "("))
    assert not matcher.allowed()[eos] and not matcher.is_finished()
    matcher.advance(encode(lm, ")"))
    assert matcher.is_finished() and matcher.is_complete() and not hasattr(matcher, "done")
    assert matcher.allowed().nonzero().flatten().tolist() == sorted(lm.eos_token_ids)
    matcher.advance([eos])
    assert not matcher.allowed().any() and matcher.is_complete() and matcher.text == "()"
    open_ended = grammars.cfg(ARITHMETIC).matcher(lm)
    open_ended.advance(encode(lm, "(1)"))
    assert open_ended.is_finished() and not open_ended.is_complete()  # "+2" may follow
    assert open_ended.allowed()[eos] and open_ended.allowed()[encode(lm, "+")[0]]


def test_advance_rollback_round_trip(lm):
    matcher = grammars.cfg(ARITHMETIC).matcher(lm)
    rng = random.Random(0)
    walked, masks = [], [matcher.allowed().clone()]
    for _ in range(60):  # a random walk through allowed tokens
        allowed = [t for t in matcher.allowed().nonzero().flatten().tolist() if t not in lm.eos_token_ids]
        token = rng.choice(allowed)
        matcher.advance([token])
        walked.append(token)
        masks.append(matcher.allowed().clone())
    assert "(" in matcher.text and len(walked) == 60
    for back in range(1, len(walked) + 1):
        matcher.rollback(1)
        assert torch.equal(matcher.allowed(), masks[-1 - back])
    assert matcher.tokens == [] and matcher.text == ""
    matcher.advance(walked)
    assert torch.equal(matcher.allowed(), masks[-1]) and matcher.tokens == walked
    matcher.rollback(len(walked))
    assert torch.equal(matcher.allowed(), masks[0])
    with pytest.raises(ValueError):
        matcher.rollback(1)


def test_forced_run_spells_the_keyword(lm, keyword):
    matcher = keyword.matcher(lm)
    forced = matcher.forced()
    assert lm.tokenizer.decode(forced) == "The quick brown fox"  # the space is held back: " 1" is one token
    assert forced == encode(lm, "The quick brown fox")  # the tokenizer's own spelling
    assert forced == matcher.grammar.new_matcher().compute_ff_tokens()  # llguidance's fast-forward tokens
    assert matcher.tokens == []  # forced() does not move the matcher
    walker = keyword.matcher(lm)
    for token in forced:  # each forced token is the only one its mask allows: greedy would pick it anyway
        assert walker.allowed().nonzero().flatten().tolist() == [token]
        walker.advance([token])
    assert walker.allowed().sum() > 1 and walker.forced() == []
    walker.advance(encode(lm, " ("))
    assert walker.forced() == []  # a number or a bracket


def test_disallowed_token_raises_and_does_not_move(lm, keyword):
    matcher = keyword.matcher(lm)
    good = matcher.forced()
    bad = encode(lm, "x")
    with pytest.raises(grammars.GrammarError, match=r"does not allow token .* after 'The quick brown fox'"):
        matcher.advance(good + bad)
    assert matcher.tokens == []
    matcher.advance(good)  # the parser was rolled back, not left in an error state
    eos = next(iter(lm.eos_token_ids))
    with pytest.raises(grammars.GrammarError, match="EOS before the grammar can finish"):
        matcher.advance([eos])
    with pytest.raises(grammars.GrammarError, match=r"does not allow token 380 \('\?'\)"):
        matcher.advance([380])  # a padding id of the logits
    assert matcher.tokens == good
    other_spelling = keyword.matcher(lm)
    with pytest.raises(grammars.GrammarError, match="does not allow token"):
        other_spelling.advance(encode(lm, "T"))  # the grammar's text, but not the canonical token


def test_masks_along(lm):
    constraint = grammars.cfg(ARITHMETIC)
    matcher = constraint.matcher(lm)
    tokens = encode(lm, "(1+(2*3))-4")
    n, masks = matcher.masks_along(tokens)
    assert n == len(tokens) and masks.shape == (n + 1, lm.vocab_size)
    assert matcher.tokens == []  # not moved
    walker = constraint.matcher(lm)
    for i, token in enumerate(tokens):
        assert torch.equal(masks[i], walker.allowed()) and masks[i][token]
        walker.advance([token])
    assert torch.equal(masks[n], walker.allowed())
    bad = tokens[:4] + encode(lm, ")") + tokens[4:]  # "(1+()" : a bracket cannot close an empty term
    n_bad, masks_bad = matcher.masks_along(bad)
    assert n_bad == 4 and masks_bad.shape == (5, lm.vocab_size) and not masks_bad[4][bad[4]]
    matcher.advance(tokens[:2])  # advancing along a walked path reuses its masks, and still matches a fresh walk
    assert torch.equal(matcher.allowed(), masks[2])
    matcher.advance(encode(lm, "*"))
    fresh = constraint.matcher(lm)
    fresh.advance(tokens[:2] + encode(lm, "*"))
    assert torch.equal(matcher.allowed(), fresh.allowed())


def test_fork_is_independent(lm, keyword):
    matcher = keyword.matcher(lm)
    matcher.advance(matcher.forced())
    before = matcher.allowed().clone()
    twin = matcher.fork()
    twin.advance(encode(lm, " (1"))
    assert len(twin.tokens) > len(matcher.tokens) and twin.text == "The quick brown fox (1"
    assert torch.equal(matcher.allowed(), before) and matcher.text == "The quick brown fox"
    matcher.advance(encode(lm, " 2"))
    assert twin.text == "The quick brown fox (1" and not twin.is_finished() and matcher.is_finished()
    twin.rollback(len(twin.tokens))
    assert matcher.text == "The quick brown fox 2"


def test_grammar_compiled_once_per_tokenizer(lm, keyword):
    assert keyword.matcher(lm).grammar is keyword.matcher(lm).grammar
    assert grammars.cfg(KEYWORD).matcher(lm).grammar is keyword.matcher(lm).grammar  # an equal constraint


# ---------------------------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "gemma", "opt"])
def test_every_output_parses(arch):
    """Greedy outputs of a random model on every prompt parse under each grammar (a valid prefix when cut off), and
    some of them nest brackets."""
    model, deepest = tiny_lm(arch), 0
    for text, parse in PARSERS.values():
        constraint = grammars.cfg(text)
        for prompt in PROMPTS:
            result = decoders.generate(model, prompt, strategy="guided", grammar=constraint, max_new_tokens=MAX)
            check_output(result, parse)
            deepest = max(deepest, nesting(result.text))
    assert deepest >= 2


def test_sampled_outputs_parse(lm):
    """Sampled outputs parse too; some finish, some nest."""
    finished, deepest = 0, 0
    for text, parse in PARSERS.values():
        constraint = grammars.cfg(text)
        for seed in range(6):
            result = decoders.generate(lm, "Give me", strategy="guided", grammar=constraint, max_new_tokens=MAX,
                                       temperature=1.0, seed=seed)
            check_output(result, parse)
            finished += result.finish_reason == "eos"
            deepest = max(deepest, nesting(result.text))
    assert finished > 0 and deepest >= 2


def test_greedy_with_cfg_equals_guided(lm, keyword):
    """greedy + grammar masks and advances; guided also fast-forwards the keyword: same tokens, fewer calls."""
    for prompt in PROMPTS:
        slow = decoders.generate(lm, prompt, strategy="greedy", grammar=keyword, max_new_tokens=MAX)
        fast = decoders.generate(lm, prompt, strategy="guided", grammar=keyword, max_new_tokens=MAX)
        assert fast.tokens == slow.tokens
        assert fast.sources[:4] == ["grammar"] * 4 and set(slow.sources) == {"target"}
        assert fast.stats.target_calls < slow.stats.target_calls


def test_sampling_with_cfg_equals_guided_for_the_same_seed(lm, keyword):
    for seed in (1, 2):
        slow = decoders.generate(lm, "Give me", strategy="greedy", grammar=keyword, temperature=1.0, seed=seed,
                                 max_new_tokens=MAX)
        fast = decoders.generate(lm, "Give me", strategy="guided", grammar=keyword, temperature=1.0, seed=seed,
                                 max_new_tokens=MAX)
        assert fast.tokens == slow.tokens


DRAFTING = ["speculative", "prompt_lookup", "threshold", "staged", "lookahead"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("strategy", DRAFTING)
def test_drafting_strategies_with_cfg_equal_guided(arch, strategy):
    """Greedy mode: every drafting strategy under a CFG returns guided's tokens."""
    model = tiny_lm(arch)
    draft = tiny_lm(arch, seed=1) if decoders.registry.get(strategy).needs_draft else None
    for text, parse in PARSERS.values():
        constraint = grammars.cfg(text)
        for prompt in PROMPTS[:3]:
            want = decoders.generate(model, prompt, strategy="guided", grammar=constraint, max_new_tokens=MAX)
            got = decoders.generate(model, prompt, strategy=strategy, grammar=constraint, draft=draft,
                                    max_new_tokens=MAX)
            assert got.tokens == want.tokens, (strategy, prompt, want.text, got.text)
            check_output(got, parse)


def test_cfg_with_the_same_model_as_draft_accepts_drafts(lm):
    """With the target as its own draft every drafted token is accepted, grammar or not."""
    constraint = grammars.cfg(ARITHMETIC)
    want = decoders.generate(lm, "Give me", strategy="guided", grammar=constraint, max_new_tokens=MAX)
    got = decoders.generate(lm, "Give me", strategy="speculative", grammar=constraint, draft=lm, max_new_tokens=MAX)
    assert got.tokens == want.tokens and got.stats.accepted == got.stats.drafted > 0


# ---------------------------------------------------------------------------------------------------- real model


@pytest.mark.real_model
def test_cfg_on_smollm2():
    zoo = pytest.importorskip("decoders.models.zoo")
    if zoo.local_path("smollm2-135m") is None:
        pytest.skip("zoo:smollm2-135m is not pulled (decodekit models pull smollm2-135m)")
    lm = decoders.load("zoo:smollm2-135m", dtype="float32", device="cpu")
    constraint = grammars.cfg(r"""
        start: "The answer is " expr "."
        expr: term (OP term)*
        term: NUMBER | "(" expr ")"
        OP: " + " | " - " | " * "
        NUMBER: /[0-9]{1,3}/
    """)
    messages = [{"role": "user", "content": "Write an arithmetic expression with brackets that equals 42."}]
    prompt = lm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    fast = decoders.generate(lm, prompt, strategy="guided", grammar=constraint, max_new_tokens=40)
    assert fast.finish_reason == "eos" and fast.text.startswith("The answer is ") and fast.text.endswith(".")
    expression = fast.text[len("The answer is "):-1]
    parse_arithmetic(re.sub(r"[0-9]+", "1", expression.replace(" ", "")))  # numbers as one digit, for the checker
    assert fast.tokens[:3] == encode(lm, "The answer is")  # forced, in the tokenizer's own spelling
    assert fast.sources[:3] == ["grammar"] * 3
    slow = decoders.generate(lm, prompt, strategy="greedy", grammar=constraint, max_new_tokens=40)
    assert slow.tokens == fast.tokens
    lookup = decoders.generate(lm, prompt, strategy="prompt_lookup", grammar=constraint, max_new_tokens=40)
    assert lookup.tokens == fast.tokens
