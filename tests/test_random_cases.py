"""Random cases across strategies, architectures, prompts, drafts, grammars, stop strings and options, each
reproducible by its number: greedy mode gives greedy's tokens, sampling mode runs to a valid end, and nothing crashes.

A session's fuzzing pass (4,539 such cases) found `auto` sampling under a grammar with a draft model crashing; this is
its seeded sample, kept small enough for CI (about half a second a case); `DECODEKIT_RANDOM_CASES=2000 pytest
tests/test_random_cases.py` runs a longer pass."""

from __future__ import annotations

import os
import random
import re

import pytest

import decoders
import grammars
from conftest import ARCHITECTURES, CORPUS, VOCAB, tiny_lm

CASES = int(os.environ.get("DECODEKIT_RANDOM_CASES", 48))
CONTEXT = 256  # the tiny models' max_position_embeddings
GRAMMARS = {  # name -> (constraint, a pattern every complete or cut output matches)
    "word": (lambda: grammars.regex(r" [a-z]+"), r" [a-z]*"),
    "choice": (lambda: grammars.choice([" red", " green", " blue"]), r" ?(r(ed?)?|g(r(e(en?)?)?)?|b(l(ue?)?)?)?"),
}
AUTO_OPTIONS = {"max_draft": [1, 2, 40], "max_tree": [1, 2, 64], "draft_trees": [True, False]}


def prompt(rng: random.Random, lm: decoders.LM) -> list[int]:
    kind = rng.choice(["random", "repeat", "repeat", "text", "eos", "long"])
    if kind == "random":
        return [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 120))]
    if kind == "repeat":  # copy-heavy: long prompt-lookup and suffix drafts
        span = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 12))]
        return (span * 40)[: rng.randint(len(span), 150)]
    if kind == "text":
        return lm.encode(rng.choice(CORPUS))
    if kind == "eos":  # EOS (id 0) inside the prompt
        return [rng.choice([0, rng.randrange(1, VOCAB)]) for _ in range(rng.randint(1, 40))]
    return [rng.randrange(1, VOCAB) for _ in range(rng.randint(200, 250))]  # up to the context's end


def case(number: int) -> dict:
    """The arguments of case `number` (the same on every run)."""
    rng = random.Random(number)
    arch = rng.choice(sorted(ARCHITECTURES))
    lm = tiny_lm(arch)
    others = decoders.available()
    strategy = "auto" if number % 2 else others[number // 2 % len(others)]  # (auto in half the cases)
    cls = decoders.registry.get(strategy)
    ids = prompt(rng, lm)
    room = CONTEXT - len(ids)
    kwargs = dict(strategy=strategy, max_new_tokens=rng.choice([1, 2, room, rng.randint(1, min(60, room))]))
    if cls.needs_draft or (cls.takes_draft and rng.random() < 0.6):
        kwargs["draft"] = rng.choice([lm, tiny_lm(arch, 1), "self:int8"])
    if getattr(cls, "needs_grammar", False) or rng.random() < 0.25:
        kwargs["grammar"] = rng.choice(sorted(GRAMMARS))
    if strategy == "auto":
        kwargs.update({name: rng.choice(values) for name, values in AUTO_OPTIONS.items() if rng.random() < 0.3})
    if rng.random() < 0.4:
        kwargs.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1000))
        if rng.random() < 0.3:
            kwargs["top_k"] = rng.choice([1, 5, 50])
    if rng.random() < 0.15:
        kwargs["stop"] = rng.choice(["e", " ", "the", "\n"])
    return dict(arch=arch, ids=ids, **kwargs)


@pytest.mark.parametrize("number", range(CASES))
def test_a_random_case(number):
    args = case(number)
    lm, ids, name = tiny_lm(args.pop("arch")), args.pop("ids"), args.get("grammar")
    if name is not None:
        args["grammar"] = GRAMMARS[name][0]()
    result = decoders.generate(lm, ids, **args)
    assert 1 <= len(result.tokens) <= args["max_new_tokens"]
    assert 0 not in result.tokens[:-1]  # nothing after an EOS
    if name is not None:
        assert re.fullmatch(GRAMMARS[name][1], result.text), result.text
    if "stop" in args:  # the output ends at the token that completes the stop string
        assert args["stop"] not in lm.tokenizer.decode(result.tokens[:-1])
    if not args.get("temperature"):
        reference = dict(strategy="guided", grammar=args["grammar"]) if name else {}
        want = decoders.generate(lm, ids, max_new_tokens=args["max_new_tokens"], stop=args.get("stop"),
                                 **reference).tokens
        assert result.tokens == want
