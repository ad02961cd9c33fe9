"""The suffix index and store behind `suffix` decoding, against brute-force counts on seeded random text (no model)."""

import random
import threading
from collections import Counter

import pytest

from decoders.drafting.suffix_index import SuffixDraft, SuffixIndex, SuffixOptions, _Node
from decoders.drafting.suffix_store import SuffixStore, propose


def texts(seed: int, count: int = 6, vocab: int = 5, longest: int = 60) -> list[list[int]]:
    """Random sequences over a small vocabulary (many repeats), one of them periodic (long repeats)."""
    rng = random.Random(seed)
    out = [[rng.randrange(vocab) for _ in range(rng.randrange(1, longest))] for _ in range(count)]
    period = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
    out.append((period * 40)[: rng.randrange(1, longest)])
    return out


def substring_counts(sequences: list[list[int]], depth: int) -> Counter:
    """count(w) for every w of 1..depth tokens, by enumeration."""
    counts = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(len(seq), start + depth) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def check_trie(index: SuffixIndex, sequences: list[list[int]]) -> None:
    """Every node and leaf holds the brute-force count; `cont` sums the children; no empty node is left behind."""
    counts = substring_counts(sequences, index.depth)
    assert len(index) == index.root.count == index.root.cont == sum(map(len, sequences))
    stack = [((), index.root)]
    while stack:
        path, node = stack.pop()
        assert node.cont == sum(1 if type(c) is int else c.count for c in node.children.values())
        for token, child in node.children.items():
            word = path + (token,)
            if type(child) is int:  # a leaf: the one occurrence, at the position it names
                assert counts[word] == 1
                seq = index._tokens[child >> 32]
                assert seq[(child & (2**32 - 1)) - len(word) + 1:][: len(word)] == list(word)
            else:
                assert child.count == counts[word] >= 1
                stack.append((word, child))
    for word, expected in counts.items():  # and the trie read as counts agrees
        assert count(index, word) == expected
    for number, seq in index._tokens.items():  # open suffixes: exactly those still growing whose path is all nodes
        walks = {start: index._walk(seq[start:]) for start in range(max(0, len(seq) - index.depth + 1), len(seq))}
        assert index._open[number] == {start: at for start, at in walks.items() if type(at) is _Node}


def count(index: SuffixIndex, word) -> int:
    """How often `word` (1 to `depth` tokens) occurs in the indexed sequences, read from the trie."""
    at = index._walk(word)
    return 0 if at is None else 1 if type(at) is int else at.count


def continuations(index: SuffixIndex, word) -> dict[int, int]:
    """{next token: count} over the occurrences of `word` (fewer than `depth` tokens) that something follows."""
    return {token: count for count, token, _ in index._ranked(index._walk(word))}


def brute_continuations(sequences: list[list[int]], word: tuple, depth: int) -> dict[int, int]:
    counts = substring_counts(sequences, depth)
    return {w[-1]: c for w, c in counts.items() if len(w) == len(word) + 1 and w[:-1] == word}


def brute_match(sequences: list[list[int]], context: list[int], depth: int, max_match: int) -> int:
    counts = substring_counts(sequences, depth)
    for m in range(min(len(context), depth - 1, max_match), 0, -1):
        suffix = tuple(context[len(context) - m:])
        if any(len(w) == m + 1 and w[:-1] == suffix for w in counts):
            return m
    return 0


@pytest.mark.parametrize("seed", range(8))
def test_counts_continuations_and_match_equal_brute_force(seed):
    rng = random.Random(100 + seed)
    sequences = texts(seed)
    depth = rng.choice([2, 3, 5, 8])
    index = SuffixIndex(depth)
    grown = [[] for _ in sequences]
    # interleave the sequences in random chunks: each grows at its end while the others grow too
    while any(len(g) < len(s) for g, s in zip(grown, sequences)):
        which = rng.choice([i for i, (g, s) in enumerate(zip(grown, sequences)) if len(g) < len(s)])
        chunk = sequences[which][len(grown[which]): len(grown[which]) + rng.randrange(1, 5)]
        index.extend(which, chunk)
        grown[which] += chunk
    check_trie(index, sequences)
    counts = substring_counts(sequences, depth)
    for word in list(counts)[:200] + [(9,), (0, 9)]:
        if len(word) < depth:
            assert continuations(index, word) == brute_continuations(sequences, word, depth)
    for _ in range(100):
        context = [rng.randrange(6) for _ in range(rng.randrange(0, 12))]
        max_match = rng.randrange(1, 10)
        assert index.match(context, max_match)[1] == brute_match(sequences, context, depth, max_match)


@pytest.mark.parametrize("seed", range(6))
def test_removing_sequences_leaves_exactly_the_counts_of_the_rest(seed):
    """Any removal order, with the other sequences still growing afterwards."""
    rng = random.Random(200 + seed)
    sequences = {i: s for i, s in enumerate(texts(seed, count=8))}
    index = SuffixIndex(rng.choice([3, 6]))
    for i, seq in sequences.items():
        index.extend(i, seq)
    for victim in rng.sample(sorted(sequences), 5):
        index.remove(victim)
        del sequences[victim]
        check_trie(index, list(sequences.values()))
        grow = rng.choice(sorted(sequences))
        more = [rng.randrange(5) for _ in range(rng.randrange(1, 10))]
        index.extend(grow, more)
        sequences[grow] = sequences[grow] + more
        check_trie(index, list(sequences.values()))
    for i in list(sequences):
        index.remove(i)
    assert len(index) == 0 and index.root.children == {}


def check_tree(tree: SuffixDraft, index: SuffixIndex, sequences, context, max_tokens, min_prob, max_depth):
    """Topological, siblings distinct and by decreasing count, bounds kept, probabilities the brute-force products,
    and best first: nothing left out beats what was kept."""
    n = len(tree.tokens)
    assert len(tree.parents) == len(tree.probs) == n <= max_tokens
    suffix = tuple(context[len(context) - tree.match:]) if tree.match else ()
    paths, depths = [], []
    for node, parent in enumerate(tree.parents):
        assert -1 <= parent < node
        paths.append((paths[parent] if parent >= 0 else ()) + (tree.tokens[node],))
        depths.append(len(paths[-1]))
    assert len(set(paths)) == n  # siblings hold distinct tokens
    assert max(depths, default=0) <= min(max_depth, index.depth - tree.match)

    def child_probs(path, p):  # {token: probability} of what follows suffix + path, brute force
        follows = brute_continuations(sequences, suffix + path, index.depth)
        total = sum(follows.values())
        return {t: p * c / total for t, c in follows.items()}

    kept = dict(zip(paths, tree.probs))
    for path, p in kept.items():
        parent_p = kept[path[:-1]] if len(path) > 1 else 1.0
        assert p == pytest.approx(child_probs(path[:-1], parent_p)[path[-1]])
        assert p >= min_prob
    for parent in range(-1, n):  # siblings in decreasing probability
        sibling_probs = [tree.probs[i] for i in range(n) if tree.parents[i] == parent]
        assert sibling_probs == sorted(sibling_probs, reverse=True)
    levels = min(max_depth, index.depth - tree.match)
    left_out = [q for path, p in [((), 1.0)] + list(kept.items()) if len(path) < levels
                for t, q in child_probs(path, p).items() if path + (t,) not in kept and q >= min_prob]
    if left_out:
        assert n == max_tokens and max(left_out) <= min(tree.probs) + 1e-12


@pytest.mark.parametrize("seed", range(8))
def test_draft_trees_are_best_first_within_the_bounds(seed):
    rng = random.Random(300 + seed)
    sequences = texts(seed, vocab=4)
    index = SuffixIndex(rng.choice([4, 7, 10]))
    for i, seq in enumerate(sequences):
        index.extend(i, seq)
    drafted = 0
    for _ in range(40):
        context = rng.choice(sequences)[: rng.randrange(1, 30)] if rng.random() < 0.7 else [rng.randrange(4)] * 3
        max_tokens, min_prob, max_depth = rng.randrange(1, 20), rng.choice([0.0, 0.05, 0.2, 0.5]), rng.randrange(1, 9)
        tree = index.draft(context, max_tokens, min_prob, max_depth=max_depth)
        assert tree.match == index.match(context)[1]
        check_tree(tree, index, sequences, context, max_tokens, min_prob, max_depth)
        drafted += len(tree.tokens) > 1
    assert drafted > 10


def test_tree_size_follows_the_match_length_and_min_match():
    index = SuffixIndex(16)
    index.extend(0, list(range(10)) * 3)  # every continuation certain
    assert index.draft([7, 3, 4], 20, depth_factor=1.0).tokens == [5, 6]  # [3, 4] matched: 2 tokens
    assert index.draft([7, 3, 4], 20, depth_factor=2.5).tokens == [5, 6, 7, 8, 9]
    assert index.draft([1, 2, 3, 4], 3, depth_factor=2.0).tokens == [5, 6, 7]  # max_tokens caps it
    assert index.draft([7, 3, 4], 20, min_match=3) == SuffixDraft(match=2)
    assert index.draft([42], 20).tokens == [] and index.draft([], 20).tokens == []
    # a long match leaves depth - match levels: 15 tokens matched in a 16-deep trie draft one level
    assert index.draft(list(range(10)) + list(range(5)), 20).tokens == [5]


def test_min_prob_prunes_rare_continuations():
    index = SuffixIndex(8)
    for i, after in enumerate([3] * 7 + [4] * 2 + [5]):
        index.extend(i, [1, 2, after, 6])
    tree = index.draft([1, 2], 10, min_prob=0.15)
    assert tree.tokens == [3, 6, 4, 6] and tree.parents == [-1, 0, -1, 2]
    assert tree.probs == pytest.approx([0.7, 0.7, 0.2, 0.2])
    assert tree.score == pytest.approx(1.8)
    assert index.draft([1, 2], 10, min_prob=0.0).tokens == [3, 6, 4, 6, 5, 6]
    assert index.draft([1, 2], 10, min_prob=0.8).tokens == []


def test_equal_counts_rank_the_latest_sequence_and_position_first():
    index = SuffixIndex(8)
    index.extend("a", [1, 2, 3, 0, 1, 2, 4])
    index.extend("b", [0, 1, 2, 5, 0])
    assert index.draft([1, 2], 3, max_depth=1).tokens == [5, 4, 3]  # seen once each
    index.extend("c", [1, 2, 4, 0])
    index.extend("a", [1, 2, 3])
    # 3 and 4 seen twice each: 4 last seen in a later sequence ("c") than 3 ("a", extended after "c")
    assert index.draft([1, 2], 3, max_depth=1).tokens == [4, 3, 5]


def test_the_run_itself_does_not_dilute_its_matches():
    """In the run's own index the context's suffix always occurs once more, at the end, followed by nothing: the
    probabilities are over the occurrences that continue."""
    index = SuffixIndex(8)
    index.extend("run", [5, 1, 2, 3, 9, 1, 2])
    assert count(index, [1, 2]) == 2
    tree = index.draft([5, 1, 2, 3, 9, 1, 2], 4)
    assert tree.match == 2 and tree.tokens == [3, 9, 1, 2] and tree.probs == [1.0] * 4


def test_propose_takes_the_higher_scoring_tree():
    options = SuffixOptions(max_tree=8, depth_factor=4.0, min_prob=0.0, max_match=8)
    local = SuffixIndex()
    local.extend("run", [1, 2, 3, 1, 2])  # after [1, 2]: 3 (and the run's own end)
    store = SuffixStore()
    assert propose(local, store, [1, 2], 8, options).tokens == [3, 1, 2]  # the store knows nothing
    store.add([7, 1, 2, 4, 4, 4, 4, 4])
    assert propose(local, store, [1, 2], 8, options).tokens == [4, 4, 4, 4, 4]  # longer certain chain: higher score
    assert propose(local, None, [1, 2], 8, options).tokens == [3, 1, 2]
    assert propose(None, store, [1, 2], 2, options).tokens == [4, 4]  # limit: levels
    assert propose(local, store, [1, 2], 0, options) == SuffixDraft()
    tied_local, tied_store = SuffixIndex(), SuffixStore()
    tied_local.extend("run", [1, 2, 3])
    tied_store.add([1, 2, 4])
    assert propose(tied_local, tied_store, [1, 2], 8, options).tokens == [3]  # equal scores: the run's own
    store.add([6, 1, 2, 3, 1, 2])  # now both give 3 1 2 first; the store's tree has more branches
    tree = propose(local, store, [1, 2], 8, options)
    assert tree.score >= propose(local, None, [1, 2], 8, options).score


def test_store_evicts_whole_sequences_first_in_first_out():
    rng = random.Random(7)
    store = SuffixStore(max_tokens=150, depth=6)
    added = []
    for round_ in range(60):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        store.add(seq, kind="prompt" if round_ % 3 == 0 else "output")
        added.append(seq)
        held = [tokens for _, tokens in store.sequences()]
        assert len(store) == sum(map(len, held)) <= 150
        assert held == added[len(added) - len(held):]  # the newest ones, in order
        assert sum(map(len, added[len(added) - len(held) - 1:])) > 150 or len(held) == len(added)
        check_trie(store._index, held)
        fresh = SuffixIndex(6)
        for i, tokens in enumerate(held):
            fresh.extend(i, tokens)
        for context in ([1, 2], [0], [3, 3, 1]):
            assert store.draft(context, 10).tokens == fresh.draft(context, 10).tokens
    # with first-in first-out eviction every node left with one occurrence became a leaf again
    stack = [store._index.root]
    while stack:
        node = stack.pop()
        assert node is store._index.root or node.count >= 2
        stack.extend(c for c in node.children.values() if type(c) is _Node)
    store.add(list(range(400)))  # longer than the store: its last 150 tokens
    assert store.sequences() == [("output", list(range(250, 400)))]
    store.clear()
    assert len(store) == 0 and store.sequences() == [] and store.draft([1], 5).tokens == []
    with pytest.raises(ValueError, match="kind"):
        store.add([1], kind="answer")


def test_drafting_while_another_thread_adds():
    """Readers see either no match or the one continuation every stored copy agrees on, never a torn state."""
    base = list(range(100, 160))  # distinct tokens: after any prefix exactly one continuation
    store = SuffixStore(max_tokens=600, depth=12)
    stop, errors, seen = threading.Event(), [], Counter()

    def writer():
        rng = random.Random(1)
        while not stop.is_set():
            store.add(base if rng.random() < 0.3 else [rng.randrange(50) for _ in range(rng.randrange(1, 80))])

    def reader(seed):
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                k = rng.randrange(1, 50)
                tree = store.draft(base[:k], 8)
                assert tree.tokens in ([], base[k: k + len(tree.tokens)]), tree
                assert tree.parents == list(range(-1, len(tree.tokens) - 1))
                seen[bool(tree.tokens)] += 1
        except Exception as error:  # noqa: BLE001  reported below
            errors.append(error)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for thread in threads:
        thread.start()
    threading.Event().wait(1.5)
    stop.set()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    assert seen[True] > 0 and len(store) <= 600
    check_trie(store._index, [tokens for _, tokens in store.sequences()])


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(max_tree=0), "max_tree must be a whole number >= 1"),
        (dict(max_tree=2.5), "max_tree"),
        (dict(depth_factor=0), "depth_factor must be a positive number"),
        (dict(depth_factor=float("inf")), "depth_factor"),
        (dict(depth_factor=True), "depth_factor"),
        (dict(min_prob=1.5), "min_prob must be a probability"),
        (dict(min_prob=-0.1), "min_prob"),
        (dict(max_match=0), "max_match"),
        (dict(min_match=0), "min_match"),
        (dict(min_match=5, max_match=3), "min_match .5. must not exceed max_match"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SuffixOptions(**options)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="depth"):
        SuffixIndex(depth=1)
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixStore(max_tokens=0)


def test_follow_appends_only_what_the_sequence_lacks():
    tokens = [5, 1, 2, 5, 1, 3, 5, 1]
    grown, whole = SuffixIndex(), SuffixIndex()
    grown.follow("run", tokens[:3])
    grown.follow("run", tokens[:3])  # nothing new
    grown.follow("run", tokens)
    whole.extend("run", tokens)
    assert len(grown) == len(whole) == len(tokens)
    assert continuations(grown, [5, 1]) == continuations(whole, [5, 1]) == {2: 1, 3: 1}
