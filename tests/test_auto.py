"""`auto` under every plan its chooser could make: whatever proposer and draft length a step picks, the output is
greedy's (the chooser's own picks depend on measured times, so the registry-wide tests see only some of them)."""

import copy
import random
import re

import pytest
import torch

import decoders
import grammars
from conftest import PROMPTS, tiny_lm
from decoders.drafting import chooser, copies
from decoders.strategies import auto
from decoders.drafting.suffix_index import SuffixDraft


@pytest.fixture(autouse=True)
def int8_copies_never_pay(monkeypatch):
    """Whether auto drafts with an int8 copy is decided by timing its calls against the original's (`copies.pays`),
    which on tiny models is noise, and once decided holds for the model (`copies.INT8_PAYS`, on its torch module): a
    copy measured cheaper in one test made the tiny Llama, as the draft of itself, draft as its own int8 copy on the
    target's cache in the tests after it, where no tree is offered. Here a copy costs what its original costs (so it
    never pays) unless a test says otherwise (`draft_int8`, `self_int8`, or its own `copies.cheaper`), and each test
    decides anew on the shared tiny models (and on their deep copies)."""
    from decoders.drafting.cost import CallCost
    from test_tree import near_draft

    for lm in (tiny_lm("llama"), tiny_lm("qwen2"), tiny_lm("phi3"), tiny_lm("gpt2"), near_draft()):
        monkeypatch.setattr(lm.model, copies.INT8_PAYS, {}, raising=False)  # (the earlier tests' verdicts back after)
    monkeypatch.setattr(copies, "call_cost", lambda lm, role="target", **options: CallCost((1,), (0.01,)))


def choosing(choose, **options) -> auto.Auto:
    """`auto` (with `options`) whose chooser plans each step by `choose`, in place of `Chooser.choose`."""
    return auto.Auto(chooser=type("Choosing", (chooser.Chooser,), {"choose": choose}), **options)


@pytest.fixture
def random_plans():
    """`auto` planning every step as a random candidate (or a plain step) and a random length, half of them probes
    (that length at least)."""
    rng = random.Random(0)

    def choose(self, candidates, context, fed=1, remaining=None):
        picked = rng.choice([*candidates, None])
        if picked is None:
            return chooser.Plan(None, 0, 1.0, 1.0)
        return chooser.Plan(picked.proposer, rng.randint(1, len(picked.accept)), 1.0, 1.0, probe=rng.random() < 0.5)

    return choosing(choose)


@pytest.mark.parametrize("arch", ["llama", "phi3", "gpt2"])
def test_any_plan_gives_greedys_tokens(arch, random_plans):
    lm = tiny_lm(arch)
    for draft in (lm, "self:int8", None):
        for prompt in PROMPTS:
            want = decoders.generate(lm, prompt, max_new_tokens=40).tokens
            got = decoders.generate(lm, prompt, strategy=random_plans, draft=draft, max_new_tokens=40)
            assert got.tokens == want
            assert sum(got.stats.details["steps"].values()) == got.stats.target_calls


def test_any_plan_samples_under_a_grammar_with_eos_in_the_drafts(random_plans):
    lm = tiny_lm("llama")
    constraint = grammars.choice([" red", " green"])
    prompt = lm.encode("Answer: red") + [0] + lm.encode("Answer: green") + [0] + lm.encode("Answer:")
    for seed in range(40):
        result = decoders.generate(lm, prompt, strategy=random_plans, draft=lm, grammar=constraint,
                                   temperature=1.0, seed=seed, max_new_tokens=12)
        assert result.text in (" red", " green")


def test_a_seed_repeats_the_sample_however_the_calls_are_timed(monkeypatch):
    """Where the caller seeds the sampling, auto plans by its calibrated costs, not by the clock: runs whose calls the
    clock times wildly apart draw the same sample and make the same steps. Calibrated here so that the draft (the
    target itself: always right) pays, so its chains and trees are drafted as well as the context's guesses and plain
    steps."""
    from decoders.drafting.cost import CallCost, CostModel

    lm = tiny_lm("llama")
    monkeypatch.setattr(auto, "calibrate", lambda target, draft=None: CostModel(
        CallCost((1, 2, 4, 8), (1.0, 1.05, 1.1, 1.2)), CallCost((1, 2, 4, 8), (0.05, 0.06, 0.07, 0.09))))

    def clocked(run: int, **kwargs) -> decoders.Result:
        rng, time = random.Random(run), [0.0]

        def clock() -> float:
            time[0] += rng.choice([1e-4, 1e-2, 1.0])
            return time[0]

        return decoders.generate(lm, PROMPTS[0] * 2, strategy=auto.Auto(clock=clock), draft=lm, max_new_tokens=32,
                                 temperature=1.0, **kwargs)

    seeded = [clocked(run, seed=11) for run in range(4)]
    assert all(result.tokens == seeded[0].tokens for result in seeded)
    assert all(result.stats.details["steps"] == seeded[0].stats.details["steps"] for result in seeded)
    assert {"draft", "tree"} & set(seeded[0].stats.details["steps"])
    assert clocked(0, seed=12).tokens != seeded[0].tokens


def guess_always(monkeypatch, guess) -> None:
    """Make the suffix index guess `guess(tokens)` after any context, sure of it."""
    monkeypatch.setattr(auto, "propose", lambda index, store, tokens, *rest, **options: SuffixDraft(
        [guess(tokens)], [-1], [1.0], match=1))


def test_in_sampling_mode_guesses_the_grammar_forbids_are_dropped_from_a_chain_checked_with_them(monkeypatch):
    """A draft model's sampled chain is checked with the context's guesses beside it (`with_guesses`), drawn under no
    grammar: a guess the grammar forbids is rejected for certain, so it is dropped from the step, where it had ended
    the run with "drafted a tree node the grammar does not allow"."""
    from decoders.drafting import cost

    def choose(self, candidates, context, fed=1, remaining=None):
        chain = next((c for c in candidates if c.proposer == "draft"), None)
        return chooser.Plan("draft", len(chain.accept), 1.0, 1.0) if chain else chooser.Plan(None, 0, 1.0, 1.0)

    lm = tiny_lm("llama")
    digit = lm.tokenizer.encode("7", add_special_tokens=False)[0]
    monkeypatch.setattr(cost.CostModel, "target_seconds", lambda self, n, context, tree=False: 1.0)
    guess_always(monkeypatch, lambda tokens: digit)
    chains = choosing(choose, draft_int8=False)
    for seed in range(5):
        result = decoders.generate(lm, PROMPTS[1], strategy=chains, draft=tiny_lm("llama", 1),
                                   grammar=grammars.regex(r" [a-z]+"), temperature=1.0, seed=seed, max_new_tokens=12)
        assert re.fullmatch(r" [a-z]+", result.text)
        assert result.stats.details["steps"].get("draft")


def test_in_sampling_mode_a_guess_the_chain_holds_already_adds_nothing_to_check(monkeypatch):
    """Where the context's guess is the chain's own token, merging adds no node: the chain is checked alone (its
    empty list of guesses had made a float tensor that `one_hot` refused)."""
    from decoders.drafting import cost

    def choose(self, candidates, context, fed=1, remaining=None):
        chain = any(c.proposer == "draft" for c in candidates)
        return chooser.Plan("draft", 1, 1.0, 1.0, probe=True) if chain else chooser.Plan(None, 0, 1.0, 1.0)

    lm = tiny_lm("llama")
    want = decoders.generate(lm, PROMPTS[0], max_new_tokens=12).tokens
    guesses = {len(lm.encode(PROMPTS[0])) + i: token for i, token in enumerate(want)}  # greedy's next token
    monkeypatch.setattr(cost.CostModel, "target_seconds", lambda self, n, context, tree=False: 1.0)
    guess_always(monkeypatch, lambda tokens: guesses[len(tokens)])
    union = auto.union  # (a chain checked alone is believed half as likely to be accepted: the guess is taken)
    monkeypatch.setattr(auto, "union", lambda paths: tuple(p if len(paths) > 1 else p / 2 for p in union(paths)))
    result = decoders.generate(lm, PROMPTS[0], strategy=choosing(choose, draft_int8=False), draft=lm, temperature=1.0,
                               top_k=1, seed=0, max_new_tokens=12)  # (top_k=1: the chain drafts the target's own token)
    assert result.tokens == want and result.stats.details["steps"].get("draft")


def test_only_the_draft_models_plans_learn_a_correction_from_their_own_steps(monkeypatch, random_plans):
    """The draft model's chains and trees draft other than their plans counted on, and their plans are corrected by
    what their steps gave (`auto.GROWN`); the draft-free proposers draft their plans' levels, whose errors their
    acceptance estimates learn, and are not corrected. A probe's plan was not chosen for its rate, and teaches no
    correction."""
    learned = []
    monkeypatch.setattr(chooser.Chooser, "learn_rate", lambda self, plan, *given: learned.append(plan))
    lm = tiny_lm("llama")
    steps = {}
    for prompt in PROMPTS:
        for name, count in decoders.generate(lm, prompt * 2, strategy=random_plans, draft=lm, max_new_tokens=40
                                             ).stats.details["steps"].items():
            steps[name] = steps.get(name, 0) + count
    assert {plan.proposer for plan in learned} == set(auto.GROWN) and not any(plan.probe for plan in learned)
    assert {"suffix", "merged", "none"} <= set(steps)  # (taken, and not learned from)


def test_a_model_without_tree_masks_gets_the_suffix_trees_main_branch(monkeypatch):
    from conftest import tiny_model, tiny_tokenizer
    from decoders.models import lm as lm_module

    lm = lm_module.wrap(tiny_model("llama"), tiny_tokenizer())
    monkeypatch.setattr(lm_module.LM, "_tree_attention_mask", lambda self, tree, positions, past: None)
    prompt = lm.encode(PROMPTS[2]) * 2  # repeated text: the suffix index drafts
    want = decoders.generate(lm, prompt, max_new_tokens=30).tokens
    got = decoders.generate(lm, prompt, strategy="auto", max_new_tokens=30)
    assert got.tokens == want and got.stats.details["steps"].get("suffix", 0) > 0


def test_draft_trees_are_offered_where_both_models_take_tree_masks(monkeypatch):
    """A draft of its own cache gets trees (staged's, on auto's draft cache) as wide as staged grows them for the
    draft's measured costs: 2 where it scores two tokens a call almost for free, 1 (a chain grown best-first, with
    the suffix index's chain checked alongside) where its calls grow with their rows; the self draft, which drafts
    on the target's cache, and `draft_trees=False` get plain chains only."""
    offered, widths = [], []

    def choose(self, candidates, context, fed=1, remaining=None):
        offered.append({c.proposer for c in candidates})
        tree = next((c for c in candidates if c.proposer == "tree"), None)
        return chooser.Plan("tree", len(tree.accept), 1.0, 1.0) if tree else chooser.Plan(None, 0, 1.0, 1.0)

    grown = auto.TreeDrafter.__init__

    def tree_drafter(self, state, options, **shared):
        widths.append(options.width)
        grown(self, state, options, **shared)

    monkeypatch.setattr(auto.TreeDrafter, "__init__", tree_drafter)
    lm, prompt = tiny_lm("llama"), PROMPTS[0]
    want = decoders.generate(lm, prompt, max_new_tokens=30).tokens
    for width in (2, 1):  # as measured for a bf16 draft, and for an int8 one
        monkeypatch.setattr(auto, "frontier_width", lambda cost, width=width: width)
        got = decoders.generate(lm, prompt, strategy=choosing(choose), draft=lm, max_new_tokens=30)
        assert got.tokens == want and got.stats.details["steps"].get("tree", 0) > 0 and got.stats.draft_calls > 0
        assert widths[-1] == width
    for draft, options in [("self:int8", {}), (lm, {"draft_trees": False})]:
        offered.clear()
        got = decoders.generate(lm, prompt, strategy=choosing(choose, **options), draft=draft, max_new_tokens=30)
        assert got.tokens == want and offered and not any("tree" in o for o in offered)
        assert any("draft" in o for o in offered)
    with pytest.raises(ValueError, match="draft_trees"):
        decoders.generate(lm, prompt, strategy="auto", draft=lm, draft_trees="no")


@pytest.mark.parametrize("rows", ["cheap", "dear"])
def test_a_trees_draft_calls_check_as_much_of_the_suffix_indexs_chain_as_pays(monkeypatch, rows):
    """The draft model's trees check the suffix index's chain under their likeliest leaf in the draft calls they make
    (staged's lower stage), cut to what pays for the call (`AutoDrafter.lead`): where a draft call's extra rows cost
    nothing, as far as it reaches; where each costs as much as a call of its own, none of it (a row saves a call only
    where the draft agrees with it)."""
    from decoders.drafting.cost import CallCost, CostModel

    def line(a, b):
        return CallCost((1, 2), (a, a + b))

    checked, own = [], []
    monkeypatch.setattr(auto, "calibrate", lambda lm, draft: CostModel(
        line(1.0, 0.02), line(0.25, 0.0 if rows == "cheap" else 0.25)))
    trees = choosing(lambda self, candidates, context, fed=1, remaining=None: next(
        (chooser.Plan("tree", len(c.accept), 1.0, 1.0) for c in candidates if c.proposer == "tree"),
        chooser.Plan(None, 0, 1.0, 1.0)), draft_int8=False)
    tree_lower = auto.AutoDrafter.tree_lower

    def recording_lower(self, tokens, room):
        own.append(self.tree.lower(tokens, room))
        checked.append(tree_lower(self, tokens, room))
        return checked[-1]

    monkeypatch.setattr(auto.AutoDrafter, "tree_lower", recording_lower)
    lm = tiny_lm("llama")
    for prompt in PROMPTS:
        want = decoders.generate(lm, prompt, max_new_tokens=40).tokens
        got = decoders.generate(lm, prompt, strategy=trees, draft=lm, max_new_tokens=40)
        assert got.tokens == want and got.stats.details["steps"].get("tree", 0) > 0
    assert all(chain == mine[: len(chain)] for chain, mine in zip(checked, own))  # a prefix of staged's chain ...
    if rows == "dear":
        assert any(own) and not any(checked)  # ... none of it where a row costs a call
    else:
        assert checked == own and any(own)


def test_tree_thresholds_are_what_pays_at_the_planned_rate():
    """Hand-computed: a node pays where its path's probability reaches rate x node seconds, a draft call where the
    likeliest leaf's reaches rate x (call + node); never below staged's thresholds, never at 1."""
    assert auto.tree_thresholds(5.0, 0.02, 0.07) == pytest.approx((0.1, 0.45))
    assert auto.tree_thresholds(5.0, 0.001, 0.02) == (auto.TREE.min_prob, auto.TREE.expand_prob)  # cheap: staged's
    assert auto.tree_thresholds(100.0, 1.0, 1.0) == (auto.SURE, auto.SURE)


@pytest.mark.parametrize("nodes", ["cheap", "dear"])
def test_a_tree_grows_only_the_nodes_and_draft_calls_that_pay_for_their_seconds(monkeypatch, nodes):
    """Each tree grows by staged's rule with the thresholds this step's planned rate and the measured costs set: where
    a node adds a quarter of a one-token call to the target's, and a draft call costs as much, a tree planned at one
    token a second takes nodes of probability 0.25 and makes further calls under leaves of 0.5; where both are all
    but free, staged's own thresholds."""
    from decoders.drafting.cost import CallCost, CostModel

    slope = 0.0 if nodes == "cheap" else 0.25
    monkeypatch.setattr(auto, "calibrate", lambda lm, draft: CostModel(
        CallCost((1, 2), (1.0, 1.0 + slope)), CallCost((1, 2), (slope, 2 * slope))))
    monkeypatch.setattr(CostModel, "observe", lambda *args, **kwargs: None)  # (the tiny model's calls take ms)
    trees = choosing(lambda self, candidates, context, fed=1, remaining=None: next(
        (chooser.Plan("tree", 1, 1.0, 1.0) for c in candidates if c.proposer == "tree"),
        chooser.Plan(None, 0, 1.0, 1.0)), draft_int8=False)
    grown, propose = [], auto.TreeDrafter.propose

    def recording(self, state, limit):
        grown.append((self.options.min_prob, self.options.expand_prob))
        return propose(self, state, limit)

    monkeypatch.setattr(auto.TreeDrafter, "propose", recording)
    lm = tiny_lm("llama")
    want = decoders.generate(lm, PROMPTS[1], max_new_tokens=30).tokens
    got = decoders.generate(lm, PROMPTS[1], strategy=trees, draft=lm, max_new_tokens=30)
    assert got.tokens == want and grown
    staged = (auto.TREE.min_prob, auto.TREE.expand_prob)
    assert all(g == (pytest.approx((0.25, 0.5)) if nodes == "dear" else staged) for g in grown)


def test_the_draft_models_first_call_is_costed_as_the_catch_up_it_is(monkeypatch):
    """The first chain drafts after the whole prompt: that call scores the prompt, and must not be taken for a
    one-token call (it made the draft look 4x dearer than it is, and auto declined it)."""
    from decoders.drafting.cost import CostModel

    observed = []
    monkeypatch.setattr(CostModel, "observe",
                        lambda self, kind, n, context, seconds, tree=False: observed.append((kind, n)))
    probes = choosing(lambda self, candidates, context, fed=1, remaining=None:
                      chooser.Plan("draft", 3, 1.0, 1.0, probe=True), draft_trees=False)
    lm = tiny_lm("llama")
    prompt = lm.encode(PROMPTS[0])
    decoders.generate(lm, prompt, strategy=probes, draft=lm, max_new_tokens=10)
    drafts = [n for kind, n in observed if kind == "draft"]
    assert drafts[:2] == [len(prompt), 1]  # the prompt's call, then the 2 one-token calls of the first chain


@pytest.mark.parametrize("pays", [False, True])
def test_a_draft_probe_drafts_its_tokens_then_on_while_the_next_one_pays(monkeypatch, pays):
    """A probe of the draft model drafts its probe tokens, then runs on as any chain does: while one more token is
    predicted to pay (`Chooser.keep_drafting`), up to max_draft."""
    drafted, update = [], chooser.Chooser.update

    def recording_update(self, proposer, n, accepted, *args):
        if proposer == "draft":
            drafted.append(n)
        update(self, proposer, n, accepted, *args)

    probes = choosing(lambda self, candidates, context, fed=1, remaining=None:
                      chooser.Plan("draft", 2, 1.0, 1.0, probe=True), draft_trees=False, draft_int8=False, max_draft=6)
    monkeypatch.setattr(chooser.Chooser, "keep_drafting", lambda self, *args, **kwargs: pays)
    monkeypatch.setattr(chooser.Chooser, "update", recording_update)
    lm = tiny_lm("llama")
    want = decoders.generate(lm, PROMPTS[0], max_new_tokens=30).tokens
    got = decoders.generate(lm, PROMPTS[0], strategy=probes, draft=lm, max_new_tokens=30)
    assert got.tokens == want
    assert drafted[0] == (6 if pays else 2) and max(drafted) == drafted[0]


@pytest.mark.parametrize("draft", ["separate", "self:int8"])
def test_the_draft_is_probed_at_once_unless_it_drafts_on_the_targets_still_empty_cache(monkeypatch, draft):
    """A draft of its own cache is offered and probed in the first step; the target's own int8 copy, which drafts on
    the target's cache, from the second (and then drafts, probed or chosen): before the first step that cache holds
    nothing, and drafting then would compute the prompt's keys and values only to throw them away."""
    offered, plans, choose = [], [], chooser.Chooser.choose

    def recording_choose(self, candidates, context, fed=1, remaining=None):
        offered.append({c.proposer for c in candidates})
        plans.append(choose(self, candidates, context, fed, remaining))
        return plans[-1]

    probed_whatever_it_costs(monkeypatch)  # (a draft that could pay)
    lm = tiny_lm("llama")
    decoders.generate(lm, PROMPTS[0], strategy=choosing(recording_choose), draft=lm if draft == "separate" else draft,
                      max_new_tokens=10)
    if draft == "separate":
        assert "draft" in offered[0] and plans[0].proposer == "draft" and plans[0].probe
    else:
        assert "draft" not in offered[0] and "draft" in offered[1] and plans[1].proposer == "draft"


@pytest.mark.parametrize("ride", [False, True])
def test_lookahead_guesses_run_the_window_in_their_steps_and_it_rides_along_where_cheap(monkeypatch, ride):
    """auto's lookahead proposer: its candidates count the Jacobi window in the tokens a call scores, a step that
    takes them scores the window (whose logits move it on), and the result is greedy's. In the other steps the
    window rides along where it adds at most RIDE to the call (here: never, or always, its rides paid for)."""
    seen = {"offered": 0, "windows": 0}

    def choose(self, candidates, context, fed=1, remaining=None):
        ahead = next((c for c in candidates if c.proposer == "lookahead"), None)
        if ahead is None:
            return chooser.Plan(None, 0, 1.0, 1.0)
        seen["offered"] += 1
        assert ahead.nodes[0] > 1  # the window's tokens plus the first level's guesses
        if seen["offered"] % 2:
            return chooser.Plan(None, 0, 1.0, 1.0)  # a plain step, which the window may ride
        return chooser.Plan("lookahead", len(ahead.accept), 1.0, 1.0)

    from decoders.proposers.lookahead import LookaheadDrafter

    update = LookaheadDrafter.update

    def counting_update(self, state, draft, accepted):
        seen["windows"] += draft.window is not None and draft.window.logits is not None
        update(self, state, draft, accepted)

    monkeypatch.setattr(LookaheadDrafter, "update", counting_update)
    monkeypatch.setattr(auto, "RIDE", float("inf") if ride else -1.0)
    monkeypatch.setattr(auto.AutoDrafter, "credit_window",
                        lambda self, state, draft, accepted: setattr(self, "window_gain", float("inf")))
    lm = tiny_lm("qwen2")
    prompt = lm.encode(PROMPTS[2]) * 2  # repeated text: the pool has guesses
    want = decoders.generate(lm, prompt, max_new_tokens=30).tokens
    got = decoders.generate(lm, prompt, strategy=choosing(choose), max_new_tokens=30)
    taken = got.stats.details["steps"].get("lookahead", 0)
    assert got.tokens == want and 0 < taken < seen["offered"]
    assert seen["windows"] == (got.stats.target_calls if ride else taken)  # riding: every step, guesses or not


@pytest.mark.parametrize("pays", [False, True])
def test_the_window_rides_along_only_while_lookaheads_guesses_pay_for_its_rides(monkeypatch, pays):
    """The window's rides may cost at most one plain step more than the target calls lookahead's guesses saved: where
    its guesses give nothing (here: never taken), it rides until then and no further."""
    from decoders.drafting.cost import CostModel
    from decoders.proposers.lookahead import LookaheadDrafter

    windows, update = [], LookaheadDrafter.update

    def counting_update(self, state, draft, accepted):
        windows.append(len(draft.window.tokens) if draft.window is not None else 0)
        update(self, state, draft, accepted)

    plain = choosing(lambda self, candidates, context, fed=1, remaining=None: chooser.Plan(None, 0, 1, 1))
    monkeypatch.setattr(LookaheadDrafter, "update", counting_update)
    monkeypatch.setattr(CostModel, "target_seconds", lambda self, n, context, tree=False: 1.0 + 0.1 * n)
    monkeypatch.setattr(auto, "RIDE", float("inf"))
    if pays:  # as if every step's accepted tokens were lookahead's alone
        credit = auto.AutoDrafter.credit_window
        monkeypatch.setattr(auto.AutoDrafter, "credit_window", lambda self, state, draft, accepted: (
            credit(self, state, draft, accepted), setattr(self, "window_gain", self.window_gain + 1.0)))
    lm = tiny_lm("qwen2")
    prompt = lm.encode(PROMPTS[2]) * 2
    got = decoders.generate(lm, prompt, strategy=plain, max_new_tokens=30)
    assert got.tokens == decoders.generate(lm, prompt, max_new_tokens=30).tokens
    rode = [n for n in windows if n]
    if pays:
        assert len(rode) == len(windows) > 2
    else:  # 0.1 s a window token: the rides' first 1.1 s, then none (the first step's window may be smaller)
        assert 0.1 * sum(rode) <= 1.1 and windows[: len(rode)] == rode and 1 <= len(rode) < len(windows) - 2


def test_a_merged_tree_credits_each_token_to_its_drafter_and_teaches_each_part(monkeypatch):
    """The suffix index's and lookahead's drafts offered as one tree: a step that takes it gives
    greedy's tokens, its accepted tokens are the drafters' (no "merged" source), and each part learns how far its own
    guesses went, never the merged tree itself."""
    updates = []

    def choose(self, candidates, context, fed=1, remaining=None):
        merged = next((c for c in candidates if c.proposer == "merged"), None)
        if merged is None:
            return chooser.Plan(None, 0, 1.0, 1.0)
        assert merged.tree and len(merged.nodes) >= len(merged.accept)
        return chooser.Plan("merged", len(merged.accept), 1.0, 1.0)

    update = chooser.Chooser.update

    def recording_update(self, proposer, drafted, accepted, *args):
        updates.append((proposer, drafted, accepted))
        update(self, proposer, drafted, accepted, *args)

    monkeypatch.setattr(chooser.Chooser, "update", recording_update)
    for lm in (tiny_lm("qwen2"), echo_lm()):
        prompt = lm.encode(PROMPTS[2]) * 3  # repeated text: the index and lookahead's pool both guess
        want = decoders.generate(lm, prompt, max_new_tokens=30)
        got = decoders.generate(lm, prompt, strategy=choosing(choose), max_new_tokens=30)
        assert got.tokens == want.tokens and got.stats.details["steps"].get("merged", 0) > 0
        assert set(got.sources) <= {"target", "suffix", "lookahead"}
    assert got.stats.accepted > 0  # the echo's: it repeats its last token, which every part soon guesses
    assert updates and {p for p, _, _ in updates} <= {"suffix", "lookahead"}
    assert all(0 <= accepted <= drafted for _, drafted, accepted in updates)


@pytest.mark.parametrize("flat", [True, False])
def test_a_draft_models_chain_is_checked_with_the_steps_guesses_where_they_pay(monkeypatch, flat):
    """In greedy mode a draft model's chain is merged with the suffix index's and lookahead's drafts
    where the step's expected tokens per second are highest so: with target calls that cost the same whatever they
    score, the guesses ride along and the step takes their tokens where the draft is wrong; where each token scored
    costs a lot, the chain goes alone. Either way the output is greedy's, and the draft's estimates learn from its
    own chain only (levels it drafted, levels of it the target took)."""
    from decoders.drafting import cost

    taught = []
    update = chooser.Chooser.update

    def choose(self, candidates, context, fed=1, remaining=None):
        chain = next((c for c in candidates if c.proposer == "draft"), None)
        return chooser.Plan("draft", 3, 1.0, 1.0, probe=True) if chain else chooser.Plan(None, 0, 1.0, 1.0)

    def recording_update(self, proposer, drafted, accepted, *args):
        taught.append((proposer, drafted, accepted))
        update(self, proposer, drafted, accepted, *args)

    chains = []
    draft_chain = auto.AutoDrafter.draft_with_model

    def recording_chain(self, *args):
        chains.append(len((chain := draft_chain(self, *args)).tokens))
        return chain

    monkeypatch.setattr(chooser.Chooser, "update", recording_update)
    monkeypatch.setattr(auto.AutoDrafter, "draft_with_model", recording_chain)
    monkeypatch.setattr(cost.CostModel, "target_seconds", lambda self, n, context, tree=False: 1.0 if flat else n ** 3)
    lm = echo_lm()  # repeats its last token, which the guesses soon guess and a random draft does not
    prompt = lm.encode(PROMPTS[2]) * 3
    want = decoders.generate(lm, prompt, max_new_tokens=30)
    got = decoders.generate(lm, prompt, strategy=choosing(choose, draft_int8=False), draft=tiny_lm("qwen2"),
                            max_new_tokens=30)
    assert got.tokens == want.tokens and got.stats.details["steps"].get("draft", 0) > 0
    guessed = set(got.sources) - {"target", "draft"}
    assert guessed if flat else not guessed
    drafts = [(drafted, accepted) for proposer, drafted, accepted in taught if proposer == "draft"]
    assert len(drafts) == len(chains)
    assert all(0 <= accepted <= drafted <= chain for (drafted, accepted), chain in zip(drafts, chains))


def test_in_sampling_mode_a_chain_checked_with_guesses_still_samples_from_the_target(monkeypatch):
    """Sampling mode: the draft model's sampled chain and the suffix index's guess (here the target's likeliest token)
    are checked in one call, each guess a one-hot sibling of the chain's first token; the first new token follows
    the target's distribution, and comes from the chain, the guess or the target."""
    from decoders.drafting import cost
    from samplers import SamplingConfig
    from stats import chi_square_fits
    from test_tree import near_draft

    def choose(self, candidates, context, fed=1, remaining=None):
        chain = any(c.proposer == "draft" for c in candidates)
        return chooser.Plan("draft", 1, 1.0, 1.0, probe=True) if chain else chooser.Plan(None, 0, 1.0, 1.0)

    lm, draft = tiny_lm("llama"), near_draft()
    prompt = lm.encode(PROMPTS[4]) * 2
    settings = dict(temperature=1.0, top_k=12)
    with torch.inference_mode():
        target = SamplingConfig(**settings).probs(lm.forward(prompt, lm.new_cache())[-1])
    guess = int(target.argmax())
    monkeypatch.setattr(cost.CostModel, "target_seconds", lambda self, n, context, tree=False: 1.0)
    guess_always(monkeypatch, lambda tokens: guess)
    firsts, sources, chains = [], [], choosing(choose, draft_int8=False)
    for seed in range(1000):
        result = decoders.generate(lm, prompt, strategy=chains, draft=draft, max_new_tokens=2, seed=seed, **settings)
        firsts.append(result.tokens[0])
        sources.append(result.sources[0])
    assert {"draft", "suffix", "target"} <= set(sources)
    assert chi_square_fits(torch.tensor(firsts), target)


def echo_lm() -> decoders.LM:
    """A tiny model that repeats its input token: its output embedding is its input embedding and its layers add
    next to nothing to the residual stream."""
    base = tiny_lm("qwen2")
    model = copy.deepcopy(base.model)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.01)
            layer.mlp.down_proj.weight.mul_(0.01)
    return decoders.wrap(model, base.tokenizer, name="tiny-echo")


def test_a_chain_teaches_the_trees_estimates_what_a_tree_would_have_caught(monkeypatch):
    """A draft model's tree holds its chain with its second choice beside each token: a chain step teaches the trees'
    estimates the chain's accepted levels, plus the rejected one where the target took the draft's second choice."""
    from test_tree import near_draft

    taught = []  # (chain's drafted, chain's accepted, tree's levels, tree's accepted)
    update = chooser.Chooser.update

    def choose(self, candidates, context, fed=1, remaining=None):
        chain = next((c for c in candidates if c.proposer == "draft"), None)
        assert chain is None or any(c.proposer == "tree" for c in candidates)  # (both models take tree masks)
        return chooser.Plan("draft", 4, 1.0, 1.0, probe=True) if chain else chooser.Plan(None, 0, 1.0, 1.0)

    def recording_update(self, proposer, drafted, accepted, *args):
        if proposer == "draft":
            taught.append([drafted, accepted])
        elif proposer == "tree":
            taught[-1] += [drafted, accepted]
        update(self, proposer, drafted, accepted, *args)

    monkeypatch.setattr(chooser.Chooser, "update", recording_update)
    lm = tiny_lm("llama")
    for prompt in PROMPTS:
        want = decoders.generate(lm, prompt, max_new_tokens=30).tokens
        got = decoders.generate(lm, prompt, strategy=choosing(choose), draft=near_draft(), max_new_tokens=30)
        assert got.tokens == want
    assert all(len(t) == 4 for t in taught)
    assert all(levels == min(drafted, accepted + 1) and accepted <= tree <= min(levels, accepted + 1)
               for drafted, accepted, levels, tree in taught)
    caught = sum(tree > accepted for _, accepted, _, tree in taught)
    missed = sum(tree == accepted < drafted for drafted, accepted, _, tree in taught)
    assert caught > 0 and missed > 0  # the near draft's second choice is the target's some of the time


def test_the_draft_drafts_as_its_int8_copy_where_the_copy_measures_cheaper(monkeypatch):
    """`draft_int8`: None drafts with the draft's own int8 copy where its one-token call is measured at most CHEAPER
    of the original's (decided once per draft; a copy found dearer is let go), True always, False never; a draft that
    is already quantized drafts as it is. Whichever drafts, the tokens are greedy's."""
    from decoders.drafting.cost import CallCost

    flat = lambda seconds: CallCost((1, 2), (seconds, seconds))  # noqa: E731
    assert copies.cheaper(flat(0.025), flat(0.059), 500, 0.8) and copies.cheaper(flat(0.8), flat(1.0), 0, 0.8)
    assert not copies.cheaper(flat(0.9), flat(1.0), 0, 0.8) and not copies.cheaper(flat(0.7), flat(1.0), 100, 0.6)

    probed_whatever_it_costs(monkeypatch)
    lm = tiny_lm("llama")
    draft = decoders.wrap(copy.deepcopy(lm.model), lm.tokenizer, name="tiny-draft")
    prompt = PROMPTS[1]
    want = decoders.generate(lm, prompt, max_new_tokens=30).tokens
    made = quantized(monkeypatch)

    def drafted_by(verdict, **options):
        monkeypatch.setattr(copies, "cheaper", lambda copy, original, context, bar: verdict)
        got = decoders.generate(lm, prompt, strategy="auto", draft=draft, max_new_tokens=30, **options)
        assert got.tokens == want and got.stats.draft_calls > 0
        return got.stats.details["draft"]

    assert drafted_by(False) == "tiny-draft" and made == [draft]  # measured dearer: made, measured, let go
    assert drafted_by(True) == "tiny-draft" and len(made) == 1  # the verdict holds for this draft
    assert drafted_by(False, draft_int8=True) == "tiny-draft:int8" and len(made) == 2
    delattr(draft.model, copies.INT8_PAYS)
    assert drafted_by(True) == "tiny-draft:int8" and len(made) == 2  # (the copy kept with the draft)
    assert drafted_by(True, draft_int8=False) == "tiny-draft"
    int8 = decoders.quantize(draft, "int8")
    got = decoders.generate(lm, prompt, strategy="auto", draft=int8, max_new_tokens=30)
    assert got.tokens == want and got.stats.details["draft"] == int8.name and len(made) == 3  # as it is
    with pytest.raises(ValueError, match="draft_int8"):
        decoders.generate(lm, prompt, strategy="auto", draft=draft, draft_int8="yes")


def test_without_a_draft_the_target_drafts_as_its_own_int8_copy_where_that_pays_and_fits(monkeypatch):
    """`self_int8`: without a draft model, the target's own int8 copy drafts (on the target's cache) where its
    one-token call is measured at most SELF of the target's and it takes at most MEMORY of the free memory; True
    always, False never. The tokens are greedy's either way."""
    probed_whatever_it_costs(monkeypatch)
    lm = tiny_lm("qwen2")
    target = decoders.wrap(copy.deepcopy(lm.model), lm.tokenizer, name="tiny-target")
    prompt = PROMPTS[0]
    want = decoders.generate(target, prompt, max_new_tokens=30).tokens
    made, bars = quantized(monkeypatch), []
    monkeypatch.setattr(copies, "cheaper", lambda copy, original, context, bar: bars.append(bar) or True)

    def drafted_by(**options):
        got = decoders.generate(target, prompt, strategy="auto", max_new_tokens=30, **options)
        assert got.tokens == want
        return got.stats.details.get("draft"), got.stats.draft_calls

    monkeypatch.setattr(copies, "free_memory", lambda device: 2 * copies.int8_bytes(target) - 1)  # short of room
    assert drafted_by() == (None, 0) and not made and not bars  # (not made to be measured either)
    delattr(target.model, copies.INT8_PAYS)
    monkeypatch.setattr(copies, "free_memory", lambda device: 2 * copies.int8_bytes(target))
    name, calls = drafted_by()
    assert name == "tiny-target:int8" and calls > 0 and made == [target] and bars == [copies.SELF]
    assert drafted_by(self_int8=False) == (None, 0)
    with pytest.raises(ValueError, match="self_int8"):
        decoders.generate(target, prompt, strategy="auto", self_int8=1)


def test_a_model_that_cannot_be_quantized_drafts_as_it_is(monkeypatch):
    """Where `decoders.quantize` cannot copy a model (it raises), auto warns and goes on without the copy."""
    from decoders.models import quantize as quantizing

    def refuse(model, scheme):
        raise ValueError(f"{model.name!r} has no nn.Linear or Conv1D layer to quantize")

    monkeypatch.setattr(quantizing, "quantize", refuse)
    lm = tiny_lm("gpt2")
    target = decoders.wrap(copy.deepcopy(lm.model), lm.tokenizer, name="tiny-unquantizable")
    want = decoders.generate(target, PROMPTS[0], max_new_tokens=20).tokens
    with pytest.warns(UserWarning, match="could not be made"):
        got = decoders.generate(target, PROMPTS[0], strategy="auto", max_new_tokens=20)
    assert got.tokens == want and "draft" not in got.stats.details and got.stats.draft_calls == 0
    with pytest.raises(ValueError, match="no nn.Linear"):  # asked for by name: the error is the caller's
        decoders.generate(target, PROMPTS[0], strategy="auto", max_new_tokens=20, self_int8=True)


def probed_whatever_it_costs(monkeypatch) -> None:
    """The break-even guard probes a draft however dear (a tiny draft as large as its target cannot pay), so that it
    drafts in a run."""
    monkeypatch.setattr(chooser.Chooser, "could_pay", lambda self, *args: True)


def quantized(monkeypatch) -> list:
    """The models `decoders.quantize` makes copies of from here on, in order."""
    from decoders.models import quantize as quantizing

    made, quantize = [], quantizing.quantize
    monkeypatch.setattr(quantizing, "quantize", lambda model, scheme: made.append(model) or quantize(model, scheme))
    return made


def test_the_evaluator_meters_the_int8_copy_auto_drafts_with(monkeypatch):
    """`decodekit compare` times draft calls with hooks on the draft's forward: also on the int8 copies kept with the
    draft and the target, which auto drafts with (a copy made inside a run was not hooked: its seconds are unknown)."""
    from decoders.registry import get
    from evals import timing

    probed_whatever_it_costs(monkeypatch)
    lm = tiny_lm("llama")
    draft = decoders.wrap(copy.deepcopy(lm.model), lm.tokenizer, name="tiny-draft")
    prompt, strategy = lm.encode(PROMPTS[0]), get("auto")(draft_int8=True)
    first, second = (timing.run_decodekit(lm, prompt, strategy, max_new_tokens=20, draft=draft) for _ in range(2))
    assert first.extra["draft"] == second.extra["draft"] == "tiny-draft:int8"
    assert first.draft_calls > 0 and first.draft_seconds is None
    assert second.draft_calls > 0 and second.draft_seconds > 0


def test_max_lookup_is_still_accepted_with_a_deprecation_warning():
    """auto drafts no prompt-lookup chains of its own any more; a caller's max_lookup= still runs, with a warning."""
    lm = tiny_lm("llama")
    want = decoders.generate(lm, PROMPTS[2], max_new_tokens=8).tokens
    with pytest.warns(DeprecationWarning, match="max_lookup has no effect"):
        got = decoders.generate(lm, PROMPTS[2], strategy="auto", max_lookup=5, max_new_tokens=8)
    assert got.tokens == want
    with pytest.raises(ValueError, match="max_lookup"):
        decoders.generate(lm, PROMPTS[2], strategy="auto", max_lookup=0, max_new_tokens=8)
