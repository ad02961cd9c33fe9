"""Token trees: the tree-masked forward, the tree verifiers, `staged` and `lookahead` beyond token equality.

(Greedy-mode equality with `greedy` on every tiny architecture is in test_equivalence.py, through the registry.)
"""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch

import decoders
import grammars
from conftest import ARCHITECTURES, PROMPTS, tiny_lm, tiny_model, tiny_tokenizer
from decoders.driver import _prepare
from decoders.drafting import Draft, Window, drafting
from decoders.drafting.grammar import restrict_to_grammar
from decoders.drafting.tree import ancestry, common, first_branch, merge, tree_call
from decoders.models.graphs import StaticKVCache
from decoders.proposers.lookahead import NgramPool, prefix_tree, window_mask
from samplers import SamplingConfig, make_generator
from samplers.verify import tree_children, verify_tree_greedy, verify_tree_sampling
from stats import chi_square_fits
from test_verify import VOCAB, logits_preferring

TREE_STRATEGIES = ["staged", "lookahead"]


@functools.cache
def near_draft(arch: str = "llama") -> decoders.LM:
    """A draft close to the target but not equal (a noisy output layer): its first choice is the target's about half
    the time, so trees get accepted through second choices too."""
    model = copy.deepcopy(tiny_lm(arch).model)
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)).to(weight.device)
                    * weight.std() * 0.3)
    return decoders.wrap(model, tiny_tokenizer(), name=f"near-{arch}")


def fresh_last(lm, tokens) -> torch.Tensor:
    return lm.forward(tokens, lm.new_cache())[-1]


def path_to(parents, node) -> list[int]:
    path = []
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    return path


# ------------------------------------------------------------------------------------------ the tree-masked forward


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_tree_masked_forward_matches_each_path(arch):
    """Each node's logits (and each window token's) equal running its own path sequentially: a random tree of 10
    nodes and a Jacobi window, after 2 uncached tail tokens, scored in one call; then the kept path continues."""
    lm = tiny_lm(arch)
    rng = random.Random(arch)
    prefix = lm.encode(PROMPTS[0] + PROMPTS[1])  # longer than the sliding windows (8) of mistral and gemma3
    tail = [rng.randrange(1, 300) for _ in range(2)]
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, 10)]
    tokens = [rng.randrange(1, 300) for _ in parents]
    levels, width = 2, 3
    window = Window([rng.randrange(1, 300) for _ in range(levels * width)],
                    [level + column for level in range(levels) for column in range(width)], window_mask(levels, width))
    state, _ = _prepare(lm, prefix + tail, max_new_tokens=20)
    with torch.inference_mode():
        lm.forward(prefix, state.cache)
        logits = state.forward(tree_call(state, Draft(tokens, None, parents, window=window)))  # [11 + 6, vocab]
        window.logits = logits[11:]
        assert len(state.cache) == len(prefix) + 2 + 10 + 6
        torch.testing.assert_close(logits[0], fresh_last(lm, prefix + tail), rtol=1e-4, atol=1e-4)
        for node in range(len(tokens)):
            path = [tokens[i] for i in path_to(parents, node)]
            torch.testing.assert_close(logits[1 + node], fresh_last(lm, prefix + tail + path), rtol=1e-4, atol=1e-4)
        for level in range(levels):
            for column in range(width):
                seen = window.tokens[: column + 1] + [window.tokens[l * width + column] for l in range(1, level + 1)]
                torch.testing.assert_close(window.logits[level * width + column],
                                           fresh_last(lm, prefix + tail + seen), rtol=1e-4, atol=1e-4)
        deepest = max(range(len(parents)), key=lambda n: len(path_to(parents, n)))
        kept = path_to(parents, deepest)
        start = len(prefix) + len(tail)
        state.cache.keep(list(range(start)) + [start + i for i in kept])
        following = lm.forward([5], state.cache)[-1]
        path = [tokens[i] for i in kept]
        torch.testing.assert_close(following, fresh_last(lm, prefix + tail + path + [5]), rtol=1e-4, atol=1e-4)


def test_draft_side_mask_can_hide_cached_nodes():
    """A [T, past + T] tree mask hides cached siblings: how the draft model grows a tree over several calls."""
    lm = tiny_lm("qwen2")
    prefix = lm.encode(PROMPTS[2])
    with torch.inference_mode():
        cache = lm.new_cache()
        lm.forward(prefix, cache)
        n = len(prefix)
        lm.forward([11, 12], cache, positions=[n, n], tree_mask=torch.eye(2, dtype=torch.bool))  # two siblings
        mask = torch.zeros(1, n + 3, dtype=torch.bool)
        mask[0, :n], mask[0, n + 1], mask[0, n + 2] = True, True, True  # child of the second sibling only
        logits = lm.forward([13], cache, positions=[n + 1], tree_mask=mask)[-1]
        torch.testing.assert_close(logits, fresh_last(lm, prefix + [12, 13]), rtol=1e-4, atol=1e-4)


def test_ancestry_and_prefix_tree():
    mask, depths = ancestry([-1, -1, 0, 2, 1])
    assert depths == [0, 0, 1, 2, 1]
    assert mask[3].tolist() == [True, False, True, True, False]
    tokens, parents = prefix_tree([(5, 6, 7), (5, 6, 8), (9,), (5, 1)])
    assert tokens == [5, 6, 7, 8, 9, 1] and parents == [-1, 0, 1, 1, -1, 0]
    assert Draft(tokens, None, parents).follow([5, 6, 8, 4]) == [0, 1, 3]
    assert Draft([1, 2, 3]).follow([1, 2]) == [0, 1] and Draft([1, 2, 3]).is_chain
    assert not Draft(tokens, None, parents).is_chain


def test_window_mask_is_a_staircase():
    mask = window_mask(3, 2)  # rows: (0,0) (0,1) (1,0) (1,1) (2,0) (2,1)
    assert mask[5].tolist() == [True, True, False, True, False, True]  # (2,1): level 0 to column 1, then column 1
    assert mask[2].tolist() == [True, False, True, False, False, False]


def test_ngram_pool_prefers_the_longer_context():
    pool = NgramPool(size=2)
    pool.add_text([1, 2, 3, 4, 9, 2, 5, 6], n=3)
    assert pool.candidates(9, 2, 4) == [(5, 6), (3, 4)]
    assert pool.candidates(1, 2, 4) == [(3, 4), (5, 6)]  # after 1, 2 came 3 4: tried first
    pool.add(None, 2, (7, 7))
    assert pool.by_token[2] == [(7, 7), (5, 6)]  # most recent first, at most `size`


# ------------------------------------------------------------------------------------------ verifiers, no model


def test_tree_greedy_follows_the_target_down_the_matching_branch():
    #        root -> 1 (node 0) -> 4 (node 3)
    #             -> 2 (node 1) -> 3 (node 2)
    tokens, parents = [1, 2, 3, 4], [-1, -1, 1, 0]
    assert verify_tree_greedy(tokens, parents, logits_preferring(2, 4, 3, 5, 0)) == ([1, 2], 5)  # bonus after node 2
    assert verify_tree_greedy(tokens, parents, logits_preferring(1, 0, 3, 5, 0)) == ([0], 0)  # recovered after node 0
    assert verify_tree_greedy(tokens, parents, logits_preferring(5, 0, 0, 0, 0)) == ([], 5)
    assert verify_tree_greedy([], [], logits_preferring(3)) == ([], 3)


def test_tree_verifiers_refuse_a_node_before_its_parent():
    with pytest.raises(ValueError, match="after their parent"):
        tree_children([1, -1])


def draw_without_replacement(p, count, generator):
    tokens, rest = [], p.clone()
    for _ in range(count):
        token = int(torch.multinomial(rest, 1, generator=generator))
        tokens.append(token)
        rest[token] = 0.0
    return tokens


@pytest.mark.parametrize("children", [1, 3])
@pytest.mark.parametrize("one_hot", [False, True])
def test_multi_candidate_rejection_sampling_reproduces_the_target(children, one_hot):
    """The first new token over many draws follows q: siblings drawn without replacement from p, or fixed ones."""
    torch.manual_seed(0)
    q = torch.softmax(torch.randn(1 + children, VOCAB) * 1.5, -1)  # [k + 1, vocab]
    p = torch.softmax(torch.randn(VOCAB) * 1.5, -1)  # a deliberately different draft
    generator = make_generator(3)
    firsts = []
    for _ in range(6000):
        tokens = [2, 4, 0][:children] if one_hot else draw_without_replacement(p, children, generator)
        probs = None if one_hot else p.expand(children, VOCAB)
        path, token = verify_tree_sampling(tokens, [-1] * children, probs, q, generator)
        firsts.append(tokens[path[0]] if path else token)
    firsts = torch.tensor(firsts)
    assert chi_square_fits(firsts, q[0])
    assert not chi_square_fits(firsts, p)


def test_a_drawn_child_before_one_hot_ones_reproduces_the_target():
    """A child drawn from p, then fixed guesses given as point-mass rows (a draft model's sampled chain merged with
    guesses from the context); a guess the draw already holds is left out."""
    torch.manual_seed(2)
    q = torch.softmax(torch.randn(4, VOCAB) * 1.5, -1)  # [k + 1, vocab]
    p = torch.softmax(torch.randn(VOCAB) * 1.5, -1)
    guesses = q[0].topk(2).indices.tolist()  # likely tokens, so their rejection reshapes what the draw must follow
    generator = make_generator(5)
    firsts, taken = [], set()
    for _ in range(6000):
        drawn = draw_without_replacement(p, 1, generator)[0]
        fixed = [g for g in guesses if g != drawn]
        tokens = [drawn, *fixed]
        rows = torch.stack([p if t == drawn else torch.nn.functional.one_hot(torch.tensor(t), VOCAB).float()
                            for t in tokens])
        path, token = verify_tree_sampling(tokens, [-1] * len(tokens), rows, q, generator)
        firsts.append(tokens[path[0]] if path else token)
        taken.add("drawn" if path and tokens[path[0]] == drawn else "guess" if path else "recovered")
    assert {"drawn", "guess"} <= taken
    assert chi_square_fits(torch.tensor(firsts), q[0])


def test_multi_candidate_second_level_follows_the_target():
    """Depth 2: given an accepted first token x, the second follows q(. | x) whichever sibling x was."""
    torch.manual_seed(1)
    q0, p0 = torch.softmax(torch.randn(VOCAB), -1), torch.softmax(torch.randn(VOCAB), -1)
    q1, p1 = torch.softmax(torch.randn(VOCAB, VOCAB), -1), torch.softmax(torch.randn(VOCAB, VOCAB) * 2, -1)
    generator = make_generator(7)
    watched = int(q0.argmax())
    seconds = []
    while len(seconds) < 5000:
        roots = draw_without_replacement(p0, 2, generator)
        tokens, parents, probs, rows = list(roots), [-1, -1], [p0, p0], [q0, q1[roots[0]], q1[roots[1]]]
        for node, x in enumerate(roots):
            for child in draw_without_replacement(p1[x], 2, generator):
                tokens.append(child)
                parents.append(node)
                probs.append(p1[x])
                rows.append(torch.full((VOCAB,), 1.0 / VOCAB))  # depth 3, not looked at
        path, token = verify_tree_sampling(tokens, parents, torch.stack(probs), torch.stack(rows), generator)
        new = [tokens[i] for i in path] + [token]
        if path and new[0] == watched:  # accepted from the tree (a recovered first token ends the step)
            seconds.append(new[1])
    assert chi_square_fits(torch.tensor(seconds), q1[watched])


def test_tree_sampling_never_accepts_what_the_target_rules_out_and_is_seeded():
    q = torch.softmax(torch.randn(3, VOCAB), -1)
    q[0, 3] = q[0, 1] = 0.0
    q = q / q.sum(-1, keepdim=True)
    for seed in range(50):
        path, token = verify_tree_sampling([3, 1], [-1, -1], None, q, make_generator(seed))
        assert path == [] and token not in (1, 3)
    runs = [verify_tree_sampling([0, 2], [-1, -1], None, q, make_generator(9)) for _ in range(2)]
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------------------ strategies on tiny models


def steps(state, decoder):
    """Run a prepared state step by step; yields (the step's draft, the accepted path's nodes) after each."""
    with torch.inference_mode():
        decoder.start(state)
        drafter = state.drafter
        propose, seen = drafter.propose, []

        def recording(state, limit):
            seen.append((yield from drafting(propose(state, limit))))
            return seen[-1]

        drafter.propose = recording
        while not state.finished:
            start = len(state.tokens)
            decoder.step(state)
            draft = seen[-1] if seen else Draft([])  # no draft when the grammar finished the run
            yield draft, draft.follow(state.tokens[start:])
            seen.clear()


def side_branch_taken(draft, path) -> bool:
    """Whether the accepted path left the first-child line (so keep() had to gather it)."""
    children = tree_children(draft.links)
    return any(children[draft.links[n] + 1][0] != n for n in path)


def holds(model, cache, tokens) -> bool:
    """Whether `cache` holds exactly what running tokens[:len(cache)] fresh gives: probe the next token."""
    n = len(cache)
    static = isinstance(cache, StaticKVCache)  # (its graphs cannot be copied; its slots past n are scratch anyway)
    probe = cache if static else copy.deepcopy(cache)
    last = model.forward(tokens[n: n + 1], probe)[-1]
    if static:
        cache.crop(n)
    return torch.allclose(last, fresh_last(model, tokens[: n + 1]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("strategy", TREE_STRATEGIES)
def test_target_and_draft_caches_hold_exactly_the_accepted_tokens(strategy):
    """After every step: target cache = the accepted tokens but the last, with the contents of running them fresh;
    the draft cache is a prefix of the tokens with the right contents too (tree paths gathered by keep())."""
    lm = tiny_lm("mistral")  # sliding window 8: rollback across the window too
    draft = near_draft("mistral") if strategy == "staged" else None
    options = dict(branching=3, min_prob=0.0, expand_prob=0.0) if strategy == "staged" else {}
    state, decoder = _prepare(lm, lm.encode(PROMPTS[1]) * 2, strategy=strategy, draft=draft, max_new_tokens=60,
                              **options)
    side_branches = 0
    for step_draft, path in steps(state, decoder):
        assert len(state.cache) == len(state.tokens) - 1
        assert holds(lm, state.cache, state.tokens)
        if draft is not None:
            draft_cache = state.drafter.proposer.model.cache
            assert len(draft_cache) <= len(state.tokens) - 1
            assert holds(draft, draft_cache, state.tokens)
        side_branches += side_branch_taken(step_draft, path)
    assert state.stats.drafted > 0
    if strategy == "staged":
        assert side_branches > 0


def test_staged_grows_a_tree_within_its_budget_and_reports_it():
    lm = tiny_lm("llama")
    result = decoders.generate(lm, PROMPTS[0], strategy="staged", draft=near_draft(), max_new_tokens=40,
                               budget=10, max_depth=4, branching=3, min_prob=0.0, expand_prob=0.0)
    stats = result.stats
    assert max(stats.draft_lengths) <= 10 and max(stats.draft_lengths) > 4  # trees, not chains
    assert len(stats.accepted_by_position) <= 4
    assert sum(stats.accepted_by_position) == stats.accepted > 0
    assert stats.drafted == sum(stats.draft_lengths)
    assert set(result.sources) <= {"draft", "target"}


@pytest.mark.parametrize("second_token, width", [(0.02, 2), (0.15, 1)])
def test_staged_expands_two_leaves_a_call_only_where_the_draft_scores_two_tokens_almost_for_free(
        monkeypatch, second_token, width):
    """width=None follows the draft's calibrated costs: a bfloat16 draft's 2-token call cost 2.5% more than its
    1-token call here, its int8 copy's 10-18% more; a frontier of 2 leaves per call pays only on the former."""
    from decoders.drafting.cost import CallCost
    from decoders.proposers import draft_tree

    monkeypatch.setattr(draft_tree, "call_cost", lambda lm, role: CallCost((1, 2), (0.1, 0.1 * (1 + second_token))))
    widths = []
    def grow_tree(model, state, o, limit, lower):
        widths.append(o.width)
        return [None]
        yield  # (a generator of draft calls, as grow_tree is)

    monkeypatch.setattr(draft_tree, "grow_tree", grow_tree)
    lm = tiny_lm("llama")
    decoders.generate(lm, PROMPTS[0], strategy="staged", draft=lm, max_new_tokens=3)
    decoders.generate(lm, PROMPTS[0], strategy="staged", draft=lm, max_new_tokens=3, width=3)
    assert widths[0] == width and widths[-1] == 3


def test_staged_lower_stage_saves_draft_calls(monkeypatch):
    """When the n-gram stage proposes what the draft model would say, its chain is accepted in one draft call."""
    from decoders.proposers import draft_tree

    lm = tiny_lm("gpt2")
    prompt = lm.encode(PROMPTS[3])
    future = decoders.generate(lm, prompt, max_new_tokens=60).tokens  # what lm, the draft here, says greedily
    oracle = lambda tokens, k, max_ngram, min_ngram: future[len(tokens) - len(prompt):][:k]  # noqa: E731
    monkeypatch.setattr(draft_tree, "lookup", oracle)
    runs = {ngram: decoders.generate(lm, prompt, strategy="staged", draft=lm, max_new_tokens=40, ngram=ngram,
                                     max_depth=6, lower="lookup") for ngram in (0, 3)}
    assert runs[0].tokens == runs[3].tokens == future[:40]
    assert runs[3].stats.draft_calls < runs[0].stats.draft_calls / 2


def test_staged_suffix_lower_stage_drafts_from_the_runs_suffix_index(monkeypatch):
    """The default lower stage asks the run's suffix index (holding the prompt and the output so far) and follows
    the main branch of its tree."""
    from decoders.drafting.suffix_index import SuffixDraft
    from decoders.proposers import draft_tree

    lm = tiny_lm("llama")
    prompt = lm.encode(PROMPTS[3])
    future = decoders.generate(lm, prompt, max_new_tokens=60).tokens
    asked = []

    def oracle(index, store, context, limit, options):  # a two-branch tree whose main branch is the future
        asked.append(len(prompt) <= len(index) <= len(context))  # the run so far; the context adds a tree path
        chain = future[len(context) - len(prompt):][:limit]
        return SuffixDraft([*chain, 7], [*range(-1, len(chain) - 1), -1], [1.0] * len(chain) + [0.1], 3)

    monkeypatch.setattr(draft_tree, "propose", oracle)
    runs = {ngram: decoders.generate(lm, prompt, strategy="staged", draft=lm, max_new_tokens=40, ngram=ngram,
                                     max_depth=6) for ngram in (0, 3)}  # ngram=0: no lower stage
    assert runs[0].tokens == runs[3].tokens == future[:40]
    assert runs[3].stats.draft_calls < runs[0].stats.draft_calls / 2
    assert asked and all(asked)


def test_lookahead_finds_copied_text():
    lm = tiny_lm("gpt2")
    prompt = lm.encode(PROMPTS[3]) * 3
    result = decoders.generate(lm, prompt, strategy="lookahead", max_new_tokens=40)
    assert result.tokens == decoders.generate(lm, prompt, max_new_tokens=40).tokens
    assert "lookahead" in result.sources and result.stats.target_calls < 30


@pytest.mark.parametrize("strategy", TREE_STRATEGIES)
def test_sampling_mode_first_token_follows_the_target_distribution(strategy, monkeypatch):
    """End to end on a model: staged with a close draft (sampled siblings), lookahead with three fixed candidates
    that are the target's likeliest tokens (one-hot siblings): the first new token still follows the target."""
    lm = tiny_lm("llama")
    prompt = lm.encode(PROMPTS[4]) * 2
    settings = dict(temperature=1.0, top_k=12)
    with torch.inference_mode():
        target = SamplingConfig(**settings).probs(lm.forward(prompt, lm.new_cache())[-1])
    if strategy == "staged":
        options = dict(draft=near_draft(), branching=3, min_prob=0.0, expand_prob=0.0, max_depth=3)
    else:
        from decoders.proposers.lookahead import NgramPool

        likeliest = [(t, 5) for t in target.topk(3).indices.tolist()]
        monkeypatch.setattr(NgramPool, "candidates", lambda self, before, key, count: likeliest)
        options = {}
    firsts, accepted = [], 0
    for seed in range(1200):
        result = decoders.generate(lm, prompt, strategy=strategy, max_new_tokens=2, seed=seed, **settings, **options)
        firsts.append(result.tokens[0])
        accepted += result.sources[0] != "target"
    assert accepted > 300  # the drafts were used, second and third siblings included
    assert chi_square_fits(torch.tensor(firsts), target)


def test_staged_sampling_takes_second_choices():
    """The multi-candidate path is exercised: some accepted draft tokens are not their parent's first child."""
    state, decoder = _prepare(tiny_lm("llama"), PROMPTS[0], strategy="staged", draft=near_draft(), max_new_tokens=60,
                              temperature=1.0, seed=0, branching=3, min_prob=0.0, expand_prob=0.0)
    assert sum(side_branch_taken(draft, path) for draft, path in steps(state, decoder)) > 0


@pytest.mark.parametrize("strategy", TREE_STRATEGIES)
@pytest.mark.parametrize("grammar", ["choice", "schema"])
def test_greedy_with_grammar_equals_guided(strategy, grammar):
    lm = tiny_lm("llama")
    constraint = grammars.choice(["red", "green", "blue"]) if grammar == "choice" else grammars.json_schema({
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150},
                       "armor": {"enum": ["leather", "chainmail", "plate"]},
                       "name": {"type": "string", "maxLength": 6}},
        "required": ["age", "armor", "name"],
    })
    draft = near_draft() if strategy == "staged" else None
    for prompt in ("Give me", '{"name": "'):
        want = decoders.generate(lm, prompt, strategy="guided", grammar=constraint, max_new_tokens=60)
        got = decoders.generate(lm, prompt, strategy=strategy, grammar=constraint, draft=draft, max_new_tokens=60)
        assert got.tokens == want.tokens
        sampled = decoders.generate(lm, prompt, strategy=strategy, grammar=constraint, draft=draft,
                                    max_new_tokens=60, temperature=1.0, seed=3)
        assert sampled.finish_reason == "eos"


def test_grammar_drops_forbidden_tree_nodes_with_their_subtrees():
    lm = tiny_lm("llama")
    matcher = grammars.choice(["red", "green"]).matcher(lm)
    r, g, b = (lm.tokenizer.encode(c, add_special_tokens=False)[0] for c in "rgb")
    draft = Draft([r, b, g, r], None, [-1, -1, -1, 1], source="lookahead")  # b and its child are forbidden
    pruned, masks = restrict_to_grammar(matcher, draft, "test")
    assert pruned.tokens == [r, g] and pruned.parents == [-1, -1] and masks.shape[0] == 3
    with pytest.raises(RuntimeError, match="does not allow"):
        restrict_to_grammar(matcher, Draft(draft.tokens, torch.zeros(4, lm.vocab_size), draft.parents), "test")


def test_guesses_merged_into_a_sampled_chain_are_dropped_where_the_grammar_forbids_them():
    """A sampled draft may carry guesses beside its drawn tokens, their rows the point mass on their tokens: a guess
    the grammar forbids is rejected for certain, so it is dropped, not an error; a drawn node it forbids still is one."""
    lm = tiny_lm("llama")
    matcher = grammars.choice(["red", "green"]).matcher(lm)
    r, g, b, e = (lm.tokenizer.encode(c, add_special_tokens=False)[0] for c in "rgbe")
    drawn = torch.full((lm.vocab_size,), 1.0 / lm.vocab_size)
    probs = torch.stack([drawn, *torch.nn.functional.one_hot(torch.tensor([b, g, e]), lm.vocab_size).float()])
    draft = Draft([r, b, g, e], probs, [-1, -1, -1, 0])  # the chain [r]; guesses b, g and e after r
    pruned, masks = restrict_to_grammar(matcher, draft, "test")
    assert pruned.tokens == [r, g, e] and pruned.parents == [-1, -1, 0] and masks.shape[0] == 4
    assert torch.equal(pruned.probs, probs[[0, 2, 3]])
    chain = Draft([b, g], torch.stack([drawn, probs[2]]), source="draft")  # a drawn first token the grammar forbids
    with pytest.raises(RuntimeError, match="does not allow"):
        restrict_to_grammar(matcher, chain, "test")
    guessed = Draft([r, b], torch.stack([drawn, probs[1]]), source="draft")  # a guess after it: cut there
    assert restrict_to_grammar(matcher, guessed, "test")[0].tokens == [r]


@pytest.mark.parametrize("strategy", TREE_STRATEGIES)
def test_a_model_without_tree_masks_fails_fast(strategy, monkeypatch):
    from decoders.models import lm as lm_module

    lm = lm_module.wrap(tiny_model("llama"), tiny_tokenizer())
    lm.native = None  # (transformers' calls, whose masks this breaks: the native step builds its own)
    monkeypatch.setattr(lm_module.LM, "_tree_attention_mask", lambda self, tree, positions, past: None)
    with pytest.raises(TypeError, match="LlamaForCausalLM cannot score a token tree"):
        draft = lm if decoders.registry.get(strategy).takes_draft else None
        decoders.generate(lm, PROMPTS[0], strategy=strategy, draft=draft, max_new_tokens=5)


@pytest.mark.parametrize(
    "strategy, options, message",
    [
        ("staged", dict(branching=0), "branching must be a whole number >= 1"),
        ("staged", dict(budget=0), "budget must be"),
        ("staged", dict(max_depth=2.5), "max_depth must be"),
        ("staged", dict(width=True), "width must be"),
        ("staged", dict(ngram=-1), "ngram must be a whole number >= 0"),
        ("staged", dict(lower="ngram"), "lower must be one of suffix, lookup"),
        ("staged", dict(min_prob=1.5), "min_prob must be a probability"),
        ("staged", dict(expand_prob=-0.1), "expand_prob must be a probability"),
        ("lookahead", dict(window=-1), "window must be a whole number >= 0"),
        ("lookahead", dict(ngram=1), "ngram must be a whole number >= 2"),
        ("lookahead", dict(guesses=0), "guesses must be"),
    ],
)
def test_bad_options_are_refused(strategy, options, message):
    lm = tiny_lm("llama")
    draft = lm if decoders.registry.get(strategy).takes_draft else None
    with pytest.raises(ValueError, match=message):
        decoders.generate(lm, PROMPTS[0], strategy=strategy, draft=draft, **options)


def test_staged_needs_a_draft():
    with pytest.raises(ValueError, match="needs a draft model"):
        decoders.generate(tiny_lm("llama"), PROMPTS[0], strategy="staged")


def test_first_branch_follows_each_nodes_first_child():
    # root -> 0 (children 2, 3) and 1; 2 -> 4; 3 -> 5: the first branch is 0, 2, 4
    tree = Draft([10, 11, 12, 13, 14, 15], parents=[-1, -1, 0, 0, 2, 3])
    assert first_branch(tree.links) == [0, 2, 4]
    assert first_branch(Draft([5, 6, 7]).links) == [0, 1, 2]  # a chain is its own first branch
    assert first_branch(Draft([]).links) == []


def test_merge_holds_every_path_once_and_credits_each_node_to_its_first_drafter():
    suffix = Draft([1, 2, 3, 4], parents=[-1, 0, 1, 0], source="suffix")  # 1 2 3, and 1 4
    lookup = Draft([1, 2, 5], source="lookup")  # 1 2 5: shares 1 2
    ahead = Draft([6, 1], parents=[-1, 0], source="lookahead")  # 6 1: a 1 under another parent is another node
    merged = merge([suffix, lookup, ahead], "merged")
    paths = {tuple(merged.tokens[n] for n in _path(merged, leaf)) for leaf in range(len(merged.tokens))
             if leaf not in merged.links}
    assert paths == {(1, 2, 3), (1, 4), (1, 2, 5), (6, 1)}
    assert len(merged.tokens) == 7  # 1 2 3 4 5 6 1
    assert [merged.source_of(merged.follow(p)[-1]) for p in ([1], [1, 2, 5], [6, 1])] == ["suffix", "lookup",
                                                                                           "lookahead"]
    assert merge([lookup]).tokens == lookup.tokens and merge([]).tokens == []
    # what is left of each part once the merged tree is cut to its first two levels
    cut = merged.subset([n for n, d in enumerate(ancestry(merged.links)[1]) if d < 2])
    assert common(suffix, cut) == [0, 1, 3] and common(lookup, cut) == [0, 1] and common(ahead, cut) == [0, 1]
    assert common(suffix, Draft([4, 2])) == []  # no path from the root in common


def _path(draft: Draft, node: int) -> list[int]:
    """The nodes from the root down to `node`."""
    path = []
    while node >= 0:
        path.insert(0, node)
        node = draft.links[node]
    return path
