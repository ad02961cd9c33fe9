"""`auto` under every plan its chooser could make, and its parts through its seams (`Auto(clock=..., chooser=...)`,
its `AutoDrafter` and proposers): whatever proposer and draft length a step picks, the output is greedy's (the
chooser's own picks depend on measured times, so the registry-wide tests see only some of them)."""

import collections
import copy
import math
import random

import pytest
import torch

import decoders
import grammars
from conftest import PROMPTS, tiny_lm, transformers_lm
from decoders.drafting import Draft, DraftVerify, chooser, copies
from decoders.drafting.cost import CallCost, CostModel
from decoders.drafting.tree import first_branch
from decoders.models.held import shared
from decoders.proposers import draft_tree
from decoders.proposers.base import Fixed
from decoders.strategies import auto


@pytest.fixture(autouse=True)
def int8_copies_never_pay(monkeypatch):
    """Whether auto drafts with an int8 copy is decided by timing its calls against the original's (`copies.pays`),
    which on tiny models is noise, and once decided holds for the model (`held.shared`, for its torch module): a
    copy measured cheaper in one test made the tiny Llama, as the draft of itself, draft as its own int8 copy on the
    target's cache in the tests after it, where no tree is offered. Here a copy costs what its original costs (so it
    never pays) unless a test says otherwise (`draft_int8`, `self_int8`, or its own `copies.cheaper`), and each test
    decides anew on the shared tiny models (and on their deep copies)."""
    for lm in (tiny_lm("llama"), tiny_lm("llama", 1), tiny_lm("qwen2"), tiny_lm("phi3"), tiny_lm("gpt2")):
        monkeypatch.setattr(shared(lm.model), "int8_pays", {})  # (the earlier tests' verdicts back after)
    monkeypatch.setattr(copies, "call_cost", lambda lm, role="target", **options: CallCost((1,), (0.01,)))


# --- seams: choosers, cost models and drafters made for a test ----------------------------------------------------


def plain() -> chooser.Plan:
    return chooser.Plan(None, 0, 1.0, 1.0)


def choosing(choose, **options) -> auto.Auto:
    """`auto` (with `options`) whose chooser plans each step by `choose(self, offers, context, remaining)`."""
    return auto.Auto(chooser=type("Choosing", (chooser.Chooser,), {"choose": choose}), **options)


def taking(name: str, levels: int | None = None, probe: bool = False):
    """A `choose` that takes `name`'s offer (its first `levels` levels, default all) wherever it is offered, else a
    plain step."""

    def choose(self, offers, context, remaining=None):
        offer = next((o for o in offers if o.proposer == name), None)
        if offer is None:
            return plain()
        return chooser.Plan(name, min(levels or len(offer.accept), len(offer.accept)), 1.0, 1.0, probe=probe)

    return choose


def priced(costs, base=chooser.Chooser, frozen: bool = False):
    """A chooser factory (auto's `chooser=`) that has the run price its calls by `costs()` (a `CostModel`) in place of
    its calibration; `frozen`: held there, not corrected by the tiny models' calls, which take milliseconds."""

    def make(cost: CostModel) -> chooser.Chooser:
        given = costs()
        cost.target, cost.draft = given.target, given.draft
        if frozen:
            cost.observe = lambda *args, **kwargs: None
        return base(cost)

    return make


def with_drafter(drafter: type, **options) -> auto.Auto:
    """`auto` (with `options`, `clock` and `chooser` included) whose runs are driven by `drafter`, an `AutoDrafter`
    subclass of the test's."""
    return type("Auto", (auto.Auto,), {"drafter": drafter})(**options)


def line(a: float, b: float) -> CallCost:
    """a + b (n - 1) seconds for a call of n tokens."""
    return CallCost((1, 2), (a, a + b))


def random_chooser(seed: int = 0) -> type:
    """A chooser planning every step as a random offer (or a plain step) and a random length, half of them probes
    (that length at least)."""
    rng = random.Random(seed)

    class RandomPlans(chooser.Chooser):
        def choose(self, offers, context, remaining=None):
            picked = rng.choice([*offers, None])
            if picked is None:
                return plain()
            return chooser.Plan(picked.proposer, rng.randint(1, len(picked.accept)), 1.0, 1.0,
                                probe=rng.random() < 0.5)

    return RandomPlans


@pytest.fixture
def random_plans() -> auto.Auto:
    return auto.Auto(chooser=random_chooser())


# --- exactness ----------------------------------------------------------------------------------------------------


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


def test_in_sampling_mode_any_plan_draws_its_token_from_the_targets_distribution(random_plans):
    """Sampling mode: whether a step checks the draft model's sampled chain or tree, the suffix index's one-hot
    guesses or nothing, its token follows the target's distribution. The prompt's call takes a plain step, so the
    step checked is the second: its token, in the runs whose first token was the likeliest, against the target's
    distribution after that token."""
    from samplers import SamplingConfig
    from stats import chi_square_fits
    from test_tree import near_draft

    lm, draft = tiny_lm("llama"), near_draft()
    words, settings = lm.encode(PROMPTS[0]), dict(temperature=1.0, top_k=12)
    with torch.inference_mode():
        lead = int(lm.forward(words * 2, lm.new_cache())[-1].argmax())
        prompt = [lead, words[0]] + words * 2  # (the suffix index guesses what follows `lead` too)
        assert int(lm.forward(prompt, lm.new_cache())[-1].argmax()) == lead  # (still the likeliest first token)
        target = SamplingConfig(**settings).probs(lm.forward(prompt + [lead], lm.new_cache())[-1])
    seconds, sources, steps = [], [], set()
    for seed in range(800):
        result = decoders.generate(lm, prompt, strategy=random_plans, draft=draft, max_new_tokens=3, seed=seed,
                                   **settings)
        assert result.sources[0] == "target"  # (the prompt's call drafts nothing)
        if result.tokens[0] == lead:
            seconds.append(result.tokens[1])
            sources.append(result.sources[1])
        steps |= set(result.stats.details["steps"])
    assert len(seconds) > 100
    assert {"draft", "target"} <= set(sources) and {"draft", "tree", "suffix", "none"} <= steps
    assert chi_square_fits(torch.tensor(seconds), target)


def test_the_prompts_call_drafts_nothing_and_carries_no_window(monkeypatch):
    """The prompt's call is a plain causal call (nodes or a window would put the prompt under a tree mask), even
    where the suffix index guesses the continuation; the steps after it draft."""
    lm = tiny_lm("llama")
    prompt = lm.encode(PROMPTS[4]) * 3
    calls = []
    forward = lm.forward

    def recording(tokens, cache, positions=None, tree_mask=None, keep=0):
        calls.append((len(tokens), tree_mask is not None))
        return forward(tokens, cache, positions, tree_mask, keep)

    monkeypatch.setattr(lm, "forward", recording)  # (this LM only: `tiny_lm` is shared)
    result = decoders.generate(lm, prompt, strategy="auto", max_new_tokens=24)
    assert calls[0] == (len(prompt), False)
    assert result.stats.drafted > 0 and result.tokens == decoders.generate(lm, prompt, max_new_tokens=24).tokens


def test_a_seed_repeats_the_sample_however_the_calls_are_timed():
    """Where the caller seeds the sampling, auto plans by its calibrated costs, not by the clock: runs whose calls the
    clock (`Auto(clock=...)`) times wildly apart draw the same sample and make the same steps. Priced here so that the
    draft (the target itself: always right) pays, so its chains and trees are drafted as well as the suffix index's
    guesses and plain steps."""
    lm = tiny_lm("llama")
    costs = priced(lambda: CostModel(CallCost((1, 2, 4, 8), (1.0, 1.05, 1.1, 1.2)),
                                     CallCost((1, 2, 4, 8), (0.05, 0.06, 0.07, 0.09))))

    def clocked(run: int, **kwargs) -> decoders.Result:
        rng, time = random.Random(run), [0.0]

        def clock() -> float:
            time[0] += rng.choice([1e-4, 1e-2, 1.0])
            return time[0]

        return decoders.generate(lm, PROMPTS[0] * 2, strategy=auto.Auto(clock=clock, chooser=costs), draft=lm,
                                 max_new_tokens=32, temperature=1.0, **kwargs)

    seeded = [clocked(run, seed=11) for run in range(4)]
    assert all(result.tokens == seeded[0].tokens for result in seeded)
    assert all(result.stats.details["steps"] == seeded[0].stats.details["steps"] for result in seeded)
    assert all(result.stats.details["predicted_seconds"] == seeded[0].stats.details["predicted_seconds"]
               for result in seeded)
    assert {"draft", "tree"} & set(seeded[0].stats.details["steps"])
    assert clocked(0, seed=12).tokens != seeded[0].tokens
    with pytest.raises(TypeError, match="clock"):
        auto.Auto(clock=1.0)


# --- the loop: proposers offer, the chooser picks, every proposer learns ------------------------------------------


class Guesser:
    """A proposer of the test's own: one level, a fixed token, believed half likely."""

    name = "guess"
    corrected = False

    def __init__(self, token: int) -> None:
        self.token, self.acceptance, self.drafted = token, chooser.Acceptance(), 0

    def offer(self, state, limit):
        return chooser.Offer(self.name, (0.5,)) if limit else None

    def draft(self, state, plan):
        self.drafted += 1
        return Draft([self.token] * plan.k, source=self.name)

    def learn(self, state, step):
        pass


class Watched:
    """A proposer as it is, the steps its `learn` sees recorded in `seen` under its name."""

    def __init__(self, proposer, seen: dict) -> None:
        self.proposer, self.seen = proposer, seen

    def __getattr__(self, name):
        return getattr(self.proposer, name)

    def learn(self, state, step):
        self.seen.setdefault(self.proposer.name, []).append(step)
        self.proposer.learn(state, step)


def test_every_proposer_learns_every_step_whoever_drafted_it():
    """Each step passes one `Step` (the plan, the draft verified, how far it was accepted, the step's tokens) to every
    proposer's `learn`, the built-in ones and one of the test's own, whichever drafted it or none."""
    lm = tiny_lm("llama")
    seen, plans, guessers, rng = {}, [], [], random.Random(1)
    taken_times = collections.Counter()

    class Recording(chooser.Chooser):
        """Plans each step as the offer (or plain step) taken least so far, of a random length, half of them probes:
        every proposer offered drafts soon, whichever offers the run's timed costs let through."""

        def choose(self, offers, context, remaining=None):
            picked = min([*offers, None], key=lambda o: taken_times[o and o.proposer])
            taken_times[picked and picked.proposer] += 1
            plans.append(plain() if picked is None else chooser.Plan(
                picked.proposer, rng.randint(1, len(picked.accept)), 1.0, 1.0, probe=rng.random() < 0.5))
            return plans[-1]

    class Drafter(auto.AutoDrafter):
        def __init__(self, state, *args):
            super().__init__(state, *args)
            guessers.append(Guesser(lm.encode(" the")[0]))
            self.proposers = [Watched(p, seen) for p in [*self.proposers, guessers[-1]]]
            self.by_name = {p.name: p for p in self.proposers}

    strategy = with_drafter(Drafter, chooser=Recording)
    taken = set()
    for prompt in PROMPTS:
        seen.clear()
        plans.clear()
        prompt = lm.encode(prompt) * 2
        want = decoders.generate(lm, prompt, max_new_tokens=30).tokens
        got = decoders.generate(lm, prompt, strategy=strategy, draft=lm, max_new_tokens=30)
        assert got.tokens == want
        assert set(seen) == {"suffix", "lookahead", "merged", "draft", "tree", "guess"}
        steps = seen["suffix"]
        assert len(steps) == len(plans) == got.stats.target_calls
        assert all(theirs == steps for theirs in seen.values())  # the same steps, in order, for every proposer
        assert [step.plan for step in steps] == plans
        assert [token for step in steps for token in step.tokens] == got.tokens
        assert [step.start for step in steps] == [len(prompt) + sum(len(s.tokens) for s in steps[:i])
                                                 for i in range(len(steps))]
        for step in steps:
            assert len(step.tokens) == step.accepted + 1 or step is steps[-1]  # (the last may end inside its draft)
            assert step.plan.proposer is not None or not step.draft.tokens
            assert step.seconds > 0
        assert guessers[-1].drafted == sum(plan.proposer == "guess" for plan in plans)
        taken |= {plan.proposer for plan in plans}
    assert taken >= {"suffix", "draft", "tree", "guess", None}


class Oracle:
    """A proposer that knows the target's greedy tokens: every level it drafts is accepted."""

    name = "oracle"
    corrected = False

    def __init__(self, want: list[int], start: int) -> None:
        self.want, self.start = want, start
        self.acceptance = chooser.Acceptance()
        self.offered, self.steps, self.finished = [], [], 0

    def offer(self, state, limit):
        rest = self.want[len(state.tokens) - self.start:][: min(limit, 4)]
        self.offered.append(len(rest))
        return chooser.Offer(self.name, (1.0,) * len(rest)) if rest else None

    def draft(self, state, plan):
        done = len(state.tokens) - self.start
        return Draft(self.want[done: done + plan.k], source=self.name)

    def learn(self, state, step):
        self.steps.append(step)

    def finish(self, state):
        self.finished += 1


@pytest.mark.parametrize("rule", ["all", "two", "none"])
def test_fixed_runs_a_proposer_by_a_fixed_plan_rule(rule):
    """`Fixed` makes a `Drafter` of a proposer and a fixed rule of how many offered levels to draft (`suffix` and
    `speculative` are made so): every step drafts that many, the proposer learns each and finishes with the run."""
    lm = tiny_lm("llama")
    prompt = lm.encode(PROMPTS[1])
    want = decoders.generate(lm, prompt, max_new_tokens=40).tokens
    oracle = Oracle(want, len(prompt))
    levels = {"two": lambda offer: min(2, len(offer.accept)), "none": lambda offer: 0}
    fixed = Fixed(oracle, levels[rule]) if rule in levels else Fixed(oracle)

    class Strategy(DraftVerify):
        drafter = staticmethod(lambda state, options: fixed)

    got = decoders.generate(lm, prompt, strategy=Strategy(), max_new_tokens=40)
    per_call = {"all": 5, "two": 3, "none": 1}[rule]  # (the oracle offers at most 4 levels, all accepted)
    assert got.tokens == want and got.stats.target_calls == math.ceil(len(want) / per_call)
    assert len(oracle.steps) == len(oracle.offered) == got.stats.target_calls and oracle.finished == 1
    assert [token for step in oracle.steps for token in step.tokens] == want
    for step, offered in zip(oracle.steps, oracle.offered):
        k = {"all": offered, "two": min(2, offered), "none": 0}[rule]
        assert (step.plan.proposer, step.plan.k) == ("oracle" if k else None, k)
        assert len(step.draft.tokens) == step.accepted == k
    assert set(got.sources) == ({"target"} if rule == "none" else {"oracle", "target"})


def test_only_the_draft_models_plans_learn_a_correction_from_their_own_steps():
    """The draft model's chains and trees draft other than their plans counted on (`corrected`), and their plans are
    corrected by what their steps gave (`Chooser.learn_rate`); the suffix index drafts its plans' levels, whose
    errors its acceptance estimates learn, and is not corrected. A probe's plan was not chosen for its rate, and
    teaches no correction; nor does the call that feeds the prompt."""
    learned = []

    class Learning(random_chooser()):
        def learn_rate(self, plan, tokens, seconds):
            learned.append(plan)
            super().learn_rate(plan, tokens, seconds)

    lm = transformers_lm("llama")  # (calls costing about the same whatever their tokens: every offer can win)
    steps = {}
    for prompt in PROMPTS:
        got = decoders.generate(lm, prompt * 2, strategy=auto.Auto(chooser=Learning), draft=lm, max_new_tokens=40)
        for name, count in got.stats.details["steps"].items():
            steps[name] = steps.get(name, 0) + count
    assert {plan.proposer for plan in learned} == {"draft", "tree"} and not any(plan.probe for plan in learned)
    assert {"suffix", "none"} <= set(steps)  # (taken, and not learned from)
    assert len(learned) < sum(steps.get(name, 0) for name in ("draft", "tree"))  # (probes, the prompt's calls)


def test_a_model_without_tree_masks_gets_the_suffix_trees_main_branch(monkeypatch):
    from conftest import tiny_model, tiny_tokenizer
    from decoders.models import lm as lm_module

    lm = lm_module.wrap(tiny_model("llama"), tiny_tokenizer())
    monkeypatch.setattr(lm, "_tree_attention_mask", lambda tree, positions, past: None)  # (this model's only)
    offers = []

    class Recording(chooser.Chooser):
        def choose(self, offers_, context, remaining=None):
            offers.extend(o for o in offers_ if o.proposer == "suffix")
            return super().choose(offers_, context, remaining)

    prompt = lm.encode(PROMPTS[2]) * 2  # repeated text: the suffix index drafts
    want = decoders.generate(lm, prompt, max_new_tokens=30).tokens
    got = decoders.generate(lm, prompt, strategy=auto.Auto(chooser=Recording), max_new_tokens=30)
    assert got.tokens == want and got.stats.details["steps"].get("suffix", 0) > 0
    assert offers and all(o.nodes == tuple(range(1, len(o.accept) + 1)) for o in offers)  # chains: a node a level


# --- the draft model's trees --------------------------------------------------------------------------------------


def test_draft_trees_are_offered_where_both_models_take_tree_masks():
    """A draft of its own cache gets trees (staged's, on auto's draft cache) as wide as staged grows them for the
    draft's measured costs: 2 where it scores more rows a call almost for free, 1 (a chain grown best-first, with
    the suffix index's chain checked alongside) where its calls grow with their rows; the self draft, which drafts
    on the target's cache, and `draft_trees=False` get plain chains only."""
    offered, widths = [], []

    def choose(self, offers, context, remaining=None):
        offered.append({o.proposer for o in offers})
        return taking("tree")(self, offers, context, remaining)

    class Drafter(auto.AutoDrafter):
        def __init__(self, state, *args):
            super().__init__(state, *args)
            if "tree" in self.by_name:
                widths.append(self.by_name["tree"].base.width)

    Choosing = type("Choosing", (chooser.Chooser,), {"choose": choose})
    lm, prompt = tiny_lm("llama"), PROMPTS[0]
    want = decoders.generate(lm, prompt, max_new_tokens=30).tokens
    for width, rows in ((2, CallCost((1, 8), (0.1, 0.1))), (1, line(0.1, 0.1))):  # (a bf16 draft's, an int8 one's)
        costs = priced(lambda rows=rows: CostModel(line(1.0, 0.02), rows), Choosing)
        got = decoders.generate(lm, prompt, strategy=with_drafter(Drafter, chooser=costs), draft=lm,
                                max_new_tokens=30)
        assert got.tokens == want and got.stats.details["steps"].get("tree", 0) > 0 and got.stats.draft_calls > 0
        assert widths[-1] == width
    for draft, options in [("self:int8", {}), (lm, {"draft_trees": False})]:
        offered.clear()
        got = decoders.generate(lm, prompt, strategy=auto.Auto(chooser=Choosing, **options), draft=draft,
                                max_new_tokens=30)
        assert got.tokens == want and offered and not any("tree" in o for o in offered)
        assert any("draft" in o for o in offered)
    with pytest.raises(ValueError, match="draft_trees"):
        decoders.generate(lm, prompt, strategy="auto", draft=lm, draft_trees="no")


@pytest.mark.parametrize("rows", ["cheap", "dear"])
def test_a_trees_draft_calls_check_as_much_of_the_suffix_indexs_chain_as_pays(rows):
    """The draft model's trees check the suffix index's chain under their likeliest leaf in the draft calls they make
    (staged's lower stage), cut to what pays for the call (`TreeProposer.lower`): where a draft call's extra rows
    cost nothing, as far as it reaches; where each costs as much as a call of its own, none of it (a row saves a call
    only where the draft agrees with it)."""
    checked, own = [], []

    class Tree(draft_tree.TreeProposer):
        def lower(self, context, room):
            own.append(self.drafter.lower(context, room))  # staged's: the index's whole chain
            checked.append(super().lower(context, room))
            return checked[-1]

    class Drafter(auto.AutoDrafter):
        def __init__(self, state, *args):
            super().__init__(state, *args)
            tree = Tree(state, self.by_name["draft"], self.by_name["suffix"], self.cost, self.clock)
            self.proposers = [tree if p.name == "tree" else p for p in self.proposers]
            self.by_name = {p.name: p for p in self.proposers}

    costs = priced(lambda: CostModel(line(1.0, 0.02), line(0.25, 0.0 if rows == "cheap" else 0.25)),
                   type("Choosing", (chooser.Chooser,), {"choose": taking("tree")}), frozen=True)
    trees = with_drafter(Drafter, chooser=costs, draft_int8=False)
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
    staged = draft_tree.StagedOptions()
    assert draft_tree.tree_thresholds(5.0, 0.02, 0.07) == pytest.approx((0.1, 0.45))
    assert draft_tree.tree_thresholds(5.0, 0.001, 0.02) == (staged.min_prob, staged.expand_prob)  # cheap: staged's
    assert draft_tree.tree_thresholds(100.0, 1.0, 1.0) == (draft_tree.SURE, draft_tree.SURE)


def test_in_a_batch_a_trees_draft_calls_are_weighed_at_the_rows_they_hold_up(monkeypatch):
    """A draft call holds up every row of a batch that is not drafting beside it (`CostModel.stall`): the tree's
    threshold for a further draft call weighs it at that many times its seconds; alone, at its seconds."""
    calls = []
    thresholds = draft_tree.tree_thresholds
    monkeypatch.setattr(draft_tree, "tree_thresholds", lambda rate, node, call: calls.append(call) or thresholds(
        rate, node, call))
    costs = priced(lambda: CostModel(line(1.0, 0.02), line(0.25, 0.0)),
                   type("Choosing", (chooser.Chooser,), {"choose": taking("tree")}), frozen=True)
    lm = tiny_lm("llama")
    trees = auto.Auto(chooser=costs, draft_int8=False)
    alone = decoders.generate(lm, PROMPTS[0], strategy=trees, draft=lm, max_new_tokens=16)
    assert alone.stats.details["steps"].get("tree", 0) > 0 and set(calls) == {0.25}
    calls.clear()
    both = decoders.generate(lm, PROMPTS[:2], strategy=trees, draft=lm, max_new_tokens=16, batch_size=2)
    assert [r.tokens for r in both] == [alone.tokens, decoders.generate(lm, PROMPTS[1], max_new_tokens=16).tokens]
    assert 0.5 in calls and set(calls) <= {0.25, 0.5}  # (two rows: until both draft, one row's call holds up two)


@pytest.mark.parametrize("nodes", ["cheap", "dear"])
def test_a_tree_grows_only_the_nodes_and_draft_calls_that_pay_for_their_seconds(nodes):
    """Each tree grows by staged's rule with the thresholds this step's planned rate and the measured costs set: where
    a node adds a quarter of a one-token call to the target's, and a draft call costs as much, a tree planned at one
    token a second takes nodes of probability 0.25 and makes further calls under leaves of 0.5; where both are all
    but free, staged's own thresholds."""
    grown = []

    class Drafter(auto.AutoDrafter):
        def propose(self, state, limit, *budget):
            draft = yield from super().propose(state, limit, *budget)  # (yields its draft model's calls)
            if self.plan.proposer == "tree":
                options = self.by_name["tree"].drafter.options
                grown.append((options.min_prob, options.expand_prob))
            return draft

    slope = 0.0 if nodes == "cheap" else 0.25
    costs = priced(lambda: CostModel(line(1.0, slope), line(slope, slope)),
                   type("Choosing", (chooser.Chooser,), {"choose": taking("tree", levels=1)}), frozen=True)
    lm = tiny_lm("llama")
    want = decoders.generate(lm, PROMPTS[1], max_new_tokens=30).tokens
    got = decoders.generate(lm, PROMPTS[1], strategy=with_drafter(Drafter, chooser=costs, draft_int8=False), draft=lm,
                            max_new_tokens=30)
    assert got.tokens == want and grown
    staged = draft_tree.StagedOptions()
    assert all(g == (pytest.approx((0.25, 0.5)) if nodes == "dear" else (staged.min_prob, staged.expand_prob))
               for g in grown)


def test_a_tree_step_teaches_the_chains_estimates_how_far_its_first_branch_went():
    """A draft model's tree holds the chain the draft would have drafted as its first branch: a tree step teaches the
    chain's estimates that branch's levels and how many of them the target took, fewer than the tree's accepted
    path where the target took a second choice."""
    from test_tree import near_draft

    taught, trees = [], []  # the chain's (drafted, accepted); the trees' (draft, accepted)

    class Estimates(chooser.Acceptance):
        def learn(self, drafted, accepted, confidences=None, curves=None):
            taught.append((drafted, accepted))
            super().learn(drafted, accepted, confidences, curves)

    class Drafter(auto.AutoDrafter):
        def __init__(self, state, *args):
            super().__init__(state, *args)
            chain = self.by_name["draft"]
            chain.acceptance = Estimates(chain.acceptance.options, chain.acceptance.prior)

        def update(self, state, draft, accepted):
            if self.plan.proposer == "tree":
                trees.append((draft, accepted))
            super().update(state, draft, accepted)

    strategy = with_drafter(Drafter, chooser=type("Choosing", (chooser.Chooser,), {"choose": taking("tree")}))
    lm, draft = tiny_lm("llama"), near_draft()
    for prompt in PROMPTS:
        want = decoders.generate(lm, prompt, max_new_tokens=30).tokens
        got = decoders.generate(lm, prompt, strategy=strategy, draft=draft, max_new_tokens=30)
        assert got.tokens == want
    assert len(taught) == len(trees) > 0  # (no chain step: the chain learns from the trees alone)
    for (drafted, taken), (tree, accepted) in zip(taught, trees):
        assert drafted == len(first_branch(tree.links)) and 0 <= taken <= min(drafted, accepted)
    assert any(taken < accepted for (_, taken), (_, accepted) in zip(taught, trees))  # a second choice taken
    assert any(0 < taken == accepted for (_, taken), (_, accepted) in zip(taught, trees))  # the first branch's


# --- the draft model's chains and probes --------------------------------------------------------------------------


def test_the_draft_models_first_call_is_costed_as_the_catch_up_it_is():
    """The first chain drafts after the whole prompt: that call scores the prompt, and must not be taken for a
    one-token call (it made the draft look 4x dearer than it is, and auto declined it)."""
    observed = []

    def recording(cost: CostModel) -> chooser.Chooser:
        observe = cost.observe

        def recorded(kind, n, context, seconds):
            observed.append((kind, n))
            observe(kind, n, context, seconds)

        cost.observe = recorded
        return type("Choosing", (chooser.Chooser,), {"choose": taking("draft", 3, probe=True)})(cost)

    lm = tiny_lm("llama")
    prompt = lm.encode(PROMPTS[0])
    decoders.generate(lm, prompt, strategy=auto.Auto(chooser=recording, draft_trees=False), draft=lm,
                      max_new_tokens=10)
    drafts = [n for kind, n in observed if kind == "draft"]
    assert drafts[:2] == [len(prompt) + 1, 1]  # the prompt and the first token, then the first chain's one-token calls


@pytest.mark.parametrize("pays", [False, True])
def test_a_draft_probe_drafts_its_tokens_then_on_while_the_next_one_pays(pays):
    """A probe of the draft model drafts its probe tokens, then runs on as any chain does: while one more token is
    predicted to pay (`Chooser.should_continue`), up to max_draft."""
    drafted = []

    class Probing(chooser.Chooser):
        choose = taking("draft", 2, probe=True)

        def should_continue(self, *args, **kwargs):
            return pays

    class Drafter(auto.AutoDrafter):
        def update(self, state, draft, accepted):
            if self.plan.proposer == "draft":
                drafted.append(len(draft.tokens))
            super().update(state, draft, accepted)

    probes = with_drafter(Drafter, chooser=Probing, draft_trees=False, draft_int8=False, max_draft=6)
    lm = tiny_lm("llama")
    want = decoders.generate(lm, PROMPTS[0], max_new_tokens=30).tokens
    got = decoders.generate(lm, PROMPTS[0], strategy=probes, draft=lm, max_new_tokens=30)
    assert got.tokens == want
    assert drafted[0] == (6 if pays else 2) and max(drafted) == drafted[0]


class Watching(chooser.Chooser):
    """The chooser as it is, each step's offers and plan (and the seconds spent before it) recorded in `seen`."""

    seen: list

    def choose(self, offers, context, remaining=None):
        spent = self.spent
        plan = super().choose(offers, context, remaining)
        self.seen.append(({o.proposer: o for o in offers}, plan, spent))
        return plan


def watching(seen: list) -> type:
    return type("Watching", (Watching,), {"seen": seen})


@pytest.mark.parametrize("draft", ["separate", "self:int8"])
def test_a_draft_is_probed_once_caught_up_the_targets_int8_copy_at_once(draft):
    """The prompt's call is offered nothing. After it, a draft of its own cache must first catch up on the prompt: not
    probed while that is more than a fifth of the run's spent seconds. The target's own int8 copy, which drafts on the
    target's cache, has nothing to catch up on: offered and probed at once. Priced so that neither draft pays for its
    rate (2 s a draft call against 1 s a target call): only a probe drafts."""
    seen = []
    costs = priced(lambda: CostModel(line(1.0, 0.0), line(2.0, 0.2)), watching(seen))
    lm = tiny_lm("llama")
    decoders.generate(lm, PROMPTS[0], strategy=auto.Auto(chooser=costs), draft=lm if draft == "separate" else draft,
                      max_new_tokens=10)
    (none, prompts, _), (first, plan, spent) = seen[:2]
    assert not none and prompts.proposer is None
    if draft == "separate":
        assert first["draft"].catch_up > spent and plan.proposer not in ("draft", "tree")
    else:
        assert first["draft"].catch_up == 0.0 and (plan.proposer, plan.probe) == ("draft", True)


def test_a_short_answer_never_pays_for_a_separate_drafts_prefill_a_long_one_probes_it():
    """End to end: a draft model of its own cache first catches up on every token of the run (its prefill, 0.05 s a
    token here against 1 s a step), and is probed only once that is at most a fifth of the seconds the run has spent
    without it (`ChooserOptions.catch_up_share`). Seeded, so auto plans by no clock: the seconds spent are its plans'.
    An answer of 8 tokens to a 46-token prompt never drafts with it; one of 64 does, from the first step where its
    catch-up is that little."""
    seen = []
    share = chooser.ChooserOptions().catch_up_share
    costs = priced(lambda: CostModel(line(1.0, 0.0), line(0.05, 0.05)), watching(seen))
    lm, draft = tiny_lm("llama"), tiny_lm("llama", 1)
    prompt = lm.encode(" ".join(PROMPTS))

    def run(tokens: int) -> decoders.Result:
        seen.clear()
        return decoders.generate(lm, prompt, strategy=auto.Auto(chooser=costs, draft_int8=False), draft=draft,
                                 max_new_tokens=tokens, temperature=1.0, seed=0)

    short = run(8)
    assert short.stats.draft_calls == 0 and not {"draft", "tree"} & set(short.stats.details["steps"])
    offered = [(offers["draft"], spent) for offers, _, spent in seen if "draft" in offers]  # (not in the prompt's
    # call, nor in the last step: no room left for a draft token)
    assert len(offered) >= len(seen) - 2 and all(share * spent < offer.catch_up for offer, spent in offered)
    long = run(64)
    assert long.stats.draft_calls > 0
    first = next(i for i, (_, plan, _) in enumerate(seen) if plan.proposer in ("draft", "tree"))
    offers, plan, spent = seen[first]
    assert plan.probe and share * spent >= offers[plan.proposer].catch_up > 0
    assert all(share * spent < offers["draft"].catch_up for offers, _, spent in seen[1:first])  # (after the prompt)
    assert first >= 8  # (later than the short answer's end)


# --- the int8 copies ----------------------------------------------------------------------------------------------


class Drafting(chooser.Chooser):
    """Takes the draft model's chain wherever offered, so that a run drafts with whatever auto drafts with."""

    choose = taking("draft", 1)


def test_the_draft_drafts_as_its_int8_copy_where_the_copy_measures_cheaper(monkeypatch):
    """`draft_int8`: None drafts with the draft's own int8 copy where its one-token call is measured at most CHEAPER
    of the original's (decided once per draft; a copy found dearer is let go), True always, False never; a draft that
    is already quantized drafts as it is. Whichever drafts, the tokens are greedy's."""
    flat = lambda seconds: CallCost((1, 2), (seconds, seconds))  # noqa: E731
    assert copies.cheaper(flat(0.025), flat(0.059), 500, 0.8) and copies.cheaper(flat(0.8), flat(1.0), 0, 0.8)
    assert not copies.cheaper(flat(0.9), flat(1.0), 0, 0.8) and not copies.cheaper(flat(0.7), flat(1.0), 100, 0.6)

    lm = tiny_lm("llama")
    draft = decoders.wrap(copy.deepcopy(lm.model), lm.tokenizer, name="tiny-draft")
    prompt = PROMPTS[1]
    want = decoders.generate(lm, prompt, max_new_tokens=30).tokens
    made = quantized(monkeypatch)

    def drafted_by(verdict, **options):
        monkeypatch.setattr(copies, "cheaper", lambda copy, original, context, bar: verdict)
        got = decoders.generate(lm, prompt, strategy=auto.Auto(chooser=Drafting, **options), draft=draft,
                                max_new_tokens=30)
        assert got.tokens == want and got.stats.draft_calls > 0
        return got.stats.details["draft"]

    assert drafted_by(False) == "tiny-draft" and made == [draft]  # measured dearer: made, measured, let go
    assert drafted_by(True) == "tiny-draft" and len(made) == 1  # the verdict holds for this draft
    assert drafted_by(False, draft_int8=True) == "tiny-draft:int8" and len(made) == 2
    shared(draft.model).int8_pays.clear()
    assert drafted_by(True) == "tiny-draft:int8" and len(made) == 2  # (the copy kept with the draft)
    assert drafted_by(True, draft_int8=False) == "tiny-draft"
    int8 = decoders.quantize(draft, "int8")
    got = decoders.generate(lm, prompt, strategy=auto.Auto(chooser=Drafting), draft=int8, max_new_tokens=30)
    assert got.tokens == want and got.stats.details["draft"] == int8.name and len(made) == 3  # as it is
    with pytest.raises(ValueError, match="draft_int8"):
        decoders.generate(lm, prompt, strategy="auto", draft=draft, draft_int8="yes")


def test_without_a_draft_the_target_drafts_as_its_own_int8_copy_where_that_pays_and_fits(monkeypatch):
    """`self_int8`: without a draft model, the target's own int8 copy drafts (on the target's cache) where its
    one-token call is measured at most SELF of the target's and it takes at most MEMORY of the free memory; True
    always, False never. The tokens are greedy's either way."""
    lm = tiny_lm("qwen2")
    target = decoders.wrap(copy.deepcopy(lm.model), lm.tokenizer, name="tiny-target")
    prompt = PROMPTS[0]
    want = decoders.generate(target, prompt, max_new_tokens=30).tokens
    made, bars = quantized(monkeypatch), []
    monkeypatch.setattr(copies, "cheaper", lambda copy, original, context, bar: bars.append(bar) or True)

    def drafted_by(**options):
        got = decoders.generate(target, prompt, strategy=auto.Auto(chooser=Drafting, **options), max_new_tokens=30)
        assert got.tokens == want
        return got.stats.details.get("draft"), got.stats.draft_calls

    monkeypatch.setattr(copies, "free_memory", lambda device: 2 * copies.int8_bytes(target) - 1)  # short of room
    assert drafted_by() == (None, 0) and not made and not bars  # (not made to be measured either)
    shared(target.model).int8_pays.clear()
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


def quantized(monkeypatch) -> list:
    """The models `decoders.quantize` makes copies of from here on, in order."""
    from decoders.models import quantize as quantizing

    made, quantize = [], quantizing.quantize
    monkeypatch.setattr(quantizing, "quantize", lambda model, scheme: made.append(model) or quantize(model, scheme))
    return made


def test_the_evaluator_meters_the_int8_copy_auto_drafts_with():
    """`decodekit compare` times draft calls with hooks on the draft's forward: also on the int8 copies kept with the
    draft and the target, which auto drafts with (a copy made inside a run was not hooked: its seconds are unknown)."""
    from evals import timing

    lm = tiny_lm("llama")
    draft = decoders.wrap(copy.deepcopy(lm.model), lm.tokenizer, name="tiny-draft")
    prompt, strategy = lm.encode(PROMPTS[0]), auto.Auto(chooser=Drafting, draft_int8=True)
    first, second = (timing.run_decodekit(lm, prompt, strategy, max_new_tokens=20, draft=draft) for _ in range(2))
    assert first.extra["draft"] == second.extra["draft"] == "tiny-draft:int8"
    assert first.draft_calls > 0 and first.draft_seconds is None
    assert second.draft_calls > 0 and second.draft_seconds > 0


def test_the_removed_max_lookup_is_refused_naming_the_options_auto_takes():
    """max_lookup= had no effect (auto drafts no prompt-lookup chains of its own) and went after its deprecation."""
    with pytest.raises(TypeError, match="unknown option.*max_lookup; its options: max_draft"):
        decoders.generate(tiny_lm("llama"), PROMPTS[2], strategy="auto", max_lookup=5, max_new_tokens=8)


def test_in_a_batch_a_step_is_priced_as_the_call_all_rows_share():
    """A row's plan costs the batch's target call, its rows padded to the batch's width (`DecodeState.batch_tokens`):
    in a batch of four rows every plan within the width costs a call of 4 x width tokens, of which the row spends a
    quarter toward a draft's prefill; alone, a plain step costs a 1-token call."""
    seen, spent = [], []

    class Recording(chooser.Chooser):
        def choose(self, offers, context, remaining=None):
            plan = super().choose(offers, context, remaining)
            seen.append((self.cost.batch_tokens, self.evaluate(None, 0, context).seconds,
                         self.cost.target.predict(max(1, self.cost.batch_tokens), context), plan.k))
            self.last = plan
            return plan

        def spend(self, seconds):  # (what a catch-up is weighed against: in a batch, a row's share of the call)
            spent.append(seconds / self.last.seconds)
            super().spend(seconds)

    lm, prompts = tiny_lm("llama"), PROMPTS[:4]
    costs = priced(lambda: CostModel(line(1.0, 0.5)), Recording, frozen=True)
    alone = [decoders.generate(lm, p, strategy=auto.Auto(chooser=costs), max_new_tokens=12).tokens for p in prompts]
    assert seen and all(tokens == 0 for tokens, *_ in seen)
    seen.clear(), spent.clear()
    batched = decoders.generate(lm, prompts, strategy=auto.Auto(chooser=costs), max_new_tokens=12, batch_size=4)
    assert [r.tokens for r in batched] == alone
    assert seen and all(tokens >= 4 and tokens % 4 == 0 for tokens, *_ in seen)  # four rows, padded alike
    assert all(plain == expected for _, plain, expected, _ in seen)
    assert all(k < tokens // 4 for tokens, _, _, k in seen)  # a plan fits the width: fed token + k drafted
    assert spent and all(share == pytest.approx(0.25) for share in spent)
