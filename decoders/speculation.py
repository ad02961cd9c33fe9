"""The one draft-then-verify loop that every drafting strategy shares, for chains and trees.

A step: the drafter proposes a `Draft`; the target scores the uncached tail plus the whole draft in one call; a
verifier (`samplers.verify`, which defines drafted / accepted / rejected / bonus / recovered) keeps a path of it and
adds one target token; the target cache is cut back to the accepted tokens; the drafter learns how far it got.

A chain is the fast path: scored causally, no mask, and the accepted path is a prefix (a crop). A tree (`parents`)
is flattened after the tail into the same single call with a tree mask - each node sees the accepted tokens, its
ancestors and itself, at position len(tokens) + its depth - and the cache keeps the prefix plus the accepted path
(`KVCache.keep`). A draft may also carry a `Window`: tokens scored in that call but never verified (lookahead's
Jacobi window), whose logits go back to the drafter.

A drafting strategy is a `DraftVerify` subclass that only says how to build its drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from decoders.base import DecodeState, Decoder
from decoders.lm import LM
from samplers.verify import verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling


@dataclass
class Window:
    """Tokens scored in the same target call as a draft but never verified (lookahead's Jacobi window).

    They see the accepted tokens and each other per `mask`, never the draft; the cache drops them after the call.
    """

    tokens: list[int]  # [w]
    offsets: list[int]  # [w] each one's position minus len(state.tokens)
    mask: torch.Tensor  # [w, w] bool, True where window token i sees window token j
    logits: torch.Tensor | None = None  # [w, vocab] set by the target call: what the target predicts after each


@dataclass
class Draft:
    """Proposed tokens: a chain, or a tree when `parents` is given (nodes in topological order, siblings in the order
    they were drawn, holding distinct tokens)."""

    tokens: list[int]  # [k]
    probs: torch.Tensor | None = None  # [k, vocab] the draft distributions they were sampled from; None = one-hot
    # (in a tree, row i is the distribution node i and its siblings were drawn from, without replacement)
    parents: list[int] | None = None  # [k] index of each node's parent in `tokens`, -1 for the root's children
    source: str = "draft"  # what `result.sources` calls an accepted draft token
    window: Window | None = None  # scored alongside, not verified

    @property
    def links(self) -> list[int]:
        """`parents`, with a chain spelled out as [-1, 0, 1, ...]."""
        return self.parents if self.parents is not None else list(range(-1, len(self.tokens) - 1))

    @property
    def is_chain(self) -> bool:
        """True when it can take the fast path: no tree, no window."""
        return self.window is None and self.links == list(range(-1, len(self.tokens) - 1))

    def follow(self, tokens: list[int]) -> list[int]:
        """The nodes spelling `tokens` from the root (siblings hold distinct tokens): an accepted path."""
        path: list[int] = []
        for token in tokens:
            above = path[-1] if path else -1
            node = next((i for i, p in enumerate(self.links) if p == above and self.tokens[i] == token), None)
            if node is None:
                break
            path.append(node)
        return path


class Drafter(Protocol):
    """Proposes drafts for one run; created per run and kept in `state.scratch`, so it may hold per-run state."""

    def propose(self, state: DecodeState, limit: int) -> Draft:
        """Up to `limit` tokens that continue `state.tokens` (may be empty); a tree at most `limit` deep."""

    def update(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        """Called after verification with how many drafted tokens were accepted (for a tree: the path's length;
        `draft.follow(the accepted tokens)` gives its nodes)."""


class DraftVerify(Decoder):
    """Base class of the drafting strategies: subclasses implement `new_drafter`."""

    scratch_key: ClassVar[str] = "drafter"
    needs_tree_mask: ClassVar[bool] = False  # drafts trees or windows: the target must take a custom mask

    def new_drafter(self, state: DecodeState) -> Drafter:
        raise NotImplementedError

    def start(self, state: DecodeState) -> None:
        if self.needs_tree_mask:
            state.lm.check_tree_mask()
        state.scratch[self.scratch_key] = self.new_drafter(state)

    def step(self, state: DecodeState) -> None:
        drafter: Drafter = state.scratch[self.scratch_key]
        grammar = state.grammar
        if grammar is not None and (forced := grammar.forced()):
            # free, always-accepted drafts: appended now, scored as part of the next target call
            state.accept(forced, ["grammar"] * len(forced))
            if state.finished:
                return
        draft = drafter.propose(state, limit=state.remaining - 1)  # leave room for the target's own token
        masks = None
        if grammar is not None:
            draft, masks = restrict_to_grammar(grammar, draft, type(drafter).__name__)  # masks: [k + 1, vocab]
        start = len(state.tokens)  # where the draft begins in the target cache after the call
        path, token = verify(state, draft, masks)
        added = state.accept([draft.tokens[i] for i in path] + [token], [draft.source] * len(path) + ["target"])
        kept = min(len(path), added)  # fewer when the run ended (EOS, stop string) inside the accepted draft
        if draft.is_chain:
            state.stats.count_accepted(len(draft.tokens) if kept == len(path) else kept, kept)
        else:
            count_tree(state, draft, len(path), kept)
        if path[:kept] == list(range(kept)):  # a prefix of the flattened draft: rollback is a crop
            state.cache.crop(min(len(state.cache), start + kept))
        else:  # the prefix plus the accepted path; the rest of the tree and any window are dropped
            state.cache.keep(list(range(start)) + [start + i for i in path[:kept]])
        state.cache.crop(min(len(state.cache), len(state.tokens) - 1))
        drafter.update(state, draft, len(path))


def verify(state: DecodeState, draft: Draft, masks: torch.Tensor | None) -> tuple[list[int], int]:
    """One target call on the uncached tail plus the draft; returns (accepted node indices, next token).

    `masks` [k + 1, vocab] (a grammar's allowed tokens at each scored position) restrict the target first.
    """
    if draft.is_chain:
        logits = state.score(draft.tokens)  # [k + 1, vocab], causal: no mask
    else:
        logits = score_tree(state, draft)  # [k + 1, vocab]
    if masks is not None:
        logits = logits.masked_fill(~masks.to(logits.device), float("-inf"))
    greedy = state.sampling.greedy
    if draft.is_chain:
        drafted = torch.tensor(draft.tokens, dtype=torch.long)  # [k]
        if greedy:
            accepted, token = verify_greedy(drafted, logits)
        else:
            accepted, token = verify_sampling(drafted, draft.probs, state.sampling.probs(logits), state.generator)
        return list(range(accepted)), token
    if greedy:
        return verify_tree_greedy(draft.tokens, draft.links, logits)
    return verify_tree_sampling(draft.tokens, draft.links, draft.probs, state.sampling.probs(logits), state.generator)


def ancestry(parents: list[int]) -> tuple[torch.Tensor, list[int]]:
    """(mask [k, k] bool: node i sees node j iff j is i or one of its ancestors, depth of each node: 0 at the root's
    children). Nodes must come after their parents."""
    k = len(parents)
    mask = torch.eye(k, dtype=torch.bool)  # [k, k]
    depths: list[int] = []
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
        depths.append(depths[parent] + 1 if parent >= 0 else 0)
    return mask, depths


def score_tree(state: DecodeState, draft: Draft) -> torch.Tensor:
    """One target call on tail + tree + window with the combined mask; returns [k + 1, vocab] (row 0 after the last
    accepted token, row 1 + i after node i) and hands the window its logits."""
    tail = state.uncached()
    window = draft.window or Window([], [], torch.zeros(0, 0, dtype=torch.bool))
    t, k, w = len(tail), len(draft.tokens), len(window.tokens)
    tree, depths = ancestry(draft.links)
    mask = torch.zeros(t + k + w, t + k + w, dtype=torch.bool)  # [T, T]
    mask[:t, :t] = torch.ones(t, t, dtype=torch.bool).tril()  # the tail is a causal chain
    mask[t:, :t] = True  # every node and window token sees the whole tail
    mask[t: t + k, t: t + k] = tree
    mask[t + k:, t + k:] = window.mask
    base = len(state.tokens)  # the position right after the last accepted token
    positions = list(range(len(state.cache), base)) + [base + d for d in depths] + [base + o for o in window.offsets]
    state.stats.target_calls += 1
    logits = state.lm.forward(tail + draft.tokens + window.tokens, state.cache, positions, mask, keep=k + w + 1)
    if draft.window is not None:
        draft.window.logits = logits[k + 1:]  # [w, vocab]
    return logits[: k + 1]


def restrict_to_grammar(grammar, draft: Draft, drafter: str) -> tuple[Draft, torch.Tensor]:
    """Cut a chain at its first token the grammar forbids, drop tree nodes it forbids on their path (with their
    subtrees); returns the draft and the allowed masks [k + 1, vocab] at each position the target scores.

    Dropping is exact only for drafters without a distribution (the target would reject the token outright and
    sample from q itself); sampled drafts are drawn under the grammar's mask and never lose a node here.
    """
    if draft.is_chain:
        valid, masks = grammar.masks_along(draft.tokens)  # [valid + 1, vocab]
        if valid == len(draft.tokens):
            return draft, masks
        if draft.probs is not None:
            raise RuntimeError(f"{drafter} drafted a token the grammar does not allow")
        return Draft(draft.tokens[:valid], None, None, draft.source), masks
    matchers, masks, kept = {-1: grammar}, [grammar.allowed()], []  # matchers: node -> grammar after its path
    for node, (token, parent) in enumerate(zip(draft.tokens, draft.links)):
        above = matchers.get(parent)
        if above is None:
            continue  # under a dropped node
        valid, after = above.masks_along([token])  # [valid + 1, vocab]
        if not valid:
            continue
        matchers[node] = above.fork()
        matchers[node].advance([token])
        masks.append(after[-1])
        kept.append(node)
    if len(kept) == len(draft.tokens):
        return draft, torch.stack(masks)
    if draft.probs is not None:
        raise RuntimeError(f"{drafter} drafted a tree node the grammar does not allow")
    index = {node: i for i, node in enumerate(kept)}
    parents = [index.get(draft.links[node], -1) for node in kept]
    pruned = Draft([draft.tokens[n] for n in kept], None, parents, draft.source, draft.window)
    return pruned, torch.stack(masks)


def count_tree(state: DecodeState, draft: Draft, accepted: int, kept: int) -> None:
    """Stats of one tree verification: drafted = the tree's size, accepted = the path's length, counted by depth."""
    stats = state.stats
    _, depths = ancestry(draft.links)
    drafted = len(draft.tokens) if kept == accepted else kept  # as for chains: a run that ended counts what it used
    stats.drafted += drafted
    stats.accepted += kept
    stats.draft_lengths.append(drafted)
    deepest = max(depths, default=-1) + 1
    if len(stats.accepted_by_position) < deepest:
        stats.accepted_by_position.extend([0] * (deepest - len(stats.accepted_by_position)))
    for depth in range(kept):
        stats.accepted_by_position[depth] += 1


class DraftModel:
    """A draft LM with its own KV cache, following the run's accepted tokens one draft token at a time."""

    def __init__(self, state: DecodeState) -> None:
        draft: LM | None = state.draft
        if draft is None:
            raise ValueError("this strategy needs a draft model: pass draft=<LM or model name>")
        state.lm.check_draft(draft)
        self.state, self.lm, self.cache = state, draft, draft.new_cache()
        self.width = min(draft.vocab_size, state.lm.vocab_size)  # ids past it are padding of one of the two models

    def next_token(self, feed: list[int], allowed: torch.Tensor | None = None) -> tuple[int, torch.Tensor | None, float]:
        """Feed tokens to the draft model; returns (token, its distribution [vocab] or None, its probability).

        Greedy mode takes the argmax; sampling mode draws from the run's filtered distribution, zero-padded to the
        target's vocabulary width. `allowed` [vocab] (a grammar's mask) restricts both.
        """
        state = self.state
        state.stats.draft_calls += 1
        logits = self.lm.forward(feed, self.cache, keep=1)[-1, : self.width]  # [width]
        if allowed is not None:
            logits = logits.masked_fill(~allowed[: self.width].to(logits.device), float("-inf"))
        if state.sampling.greedy:
            token = int(logits.argmax())
            return token, None, float(torch.softmax(logits.float(), -1)[token])
        probs = torch.zeros(state.lm.vocab_size, device=state.lm.device)  # [vocab]
        probs[: self.width] = state.sampling.probs(logits).to(probs.device)
        token = int(torch.multinomial(probs, 1, generator=state.generator))
        return token, probs, float(probs[token])

    def uncached(self) -> list[int]:
        """The run's tokens this draft model has not seen yet."""
        return self.state.tokens[len(self.cache):]

    def draft_chain(self, limit: int, keep_going=lambda prob: True) -> tuple[list[int], list, list[float]]:
        """Draft up to `limit` tokens one call at a time, under the run's grammar if any, while `keep_going(p)` holds
        for p = the draft's probability of the chain so far. Returns (tokens, distributions, cumulative probs)."""
        grammar = self.state.grammar.fork() if self.state.grammar is not None else None
        tokens, rows, cumulative = [], [], []
        feed, running = self.uncached(), 1.0
        for _ in range(limit):
            if grammar is not None and grammar.is_complete():
                break
            allowed = grammar.allowed() if grammar is not None else None
            token, probs, prob = self.next_token(feed, allowed)
            running *= prob
            tokens.append(token)
            rows.append(probs)
            cumulative.append(running)
            if token in self.state.lm.eos_token_ids or not keep_going(running):
                break
            if grammar is not None:
                grammar.advance([token])
            feed = [token]
        return tokens, rows, cumulative

    def rewind(self) -> None:
        """Forget drafted positions the target did not accept: keep only a prefix of the run's tokens."""
        self.cache.crop(min(len(self.cache), len(self.state.tokens) - 1))


def stack_probs(rows: list[torch.Tensor | None]) -> torch.Tensor | None:
    """[k, vocab] from per-token draft distributions, or None in greedy mode (or for an empty draft)."""
    if not rows or rows[0] is None:
        return None
    return torch.stack(rows)
