"""Verifiers: decide how much of a drafted chain the target keeps, and which token it adds after it.

The words, used the same way in code, stats and reports:

- **drafted**: tokens a drafter proposed for the target to check (draft model, prompt lookup, ...).
- **accepted**: drafted tokens the target keeps; always a prefix of the chain.
- **rejected**: the first drafted token the target does not keep; everything after it is discarded unseen.
- **bonus**: the extra token the target adds after a fully accepted draft, from its logits at the last position,
  which the same call computed anyway.
- **recovered**: the token the target adds in place of a rejected one. Greedy: the target's argmax there. Sampling:
  a draw from the residual distribution norm(max(0, q - p)).

So one verification always yields `accepted + 1` new tokens. Following gpt-fast, `q` is the target's probability
and `p` the draft's. Greedy mode accepts while the target's argmax equals the drafted token, which reproduces greedy
decoding exactly. Sampling mode is the rejection sampling of Leviathan et al. (2023) and Chen et al. (2023): accept
drafted token x with probability min(1, q(x) / p(x)), so every new token is distributed exactly as the target's q.
A drafter without a distribution (prompt lookup, lookahead) is one-hot: p(x) = 1.

Trees (`verify_tree_greedy`, `verify_tree_sampling`): the draft is a token tree in topological order, `parents[i]`
the index of node i's parent (-1: a child of the last accepted token), and row 0 of the target's scores is the
position after the last accepted token, row 1 + i the position after node i. **accepted** is then a root-to-leaf
path (node indices), at most one node per depth; **rejected** are the children tried at the path's last node; the
**bonus** or **recovered** token follows the path's last node. Sampling mode is multi-candidate rejection sampling
(SpecInfer, Miao et al. 2023; Yang et al. 2024): the children of a node are tried in index order; child x is
accepted with probability min(1, q(x) / p_j(x)) and on rejection q <- norm(max(0, q - p_j)), where p_j is the
distribution child j was drawn from. A sampling drafter must draw the children of a node one after another
*without replacement* from one distribution p (siblings share their row of `draft_probs`), so p_j is p with the
earlier drawn siblings' tokens removed and renormalized; it may decide how many children to draw from anything drawn
before, but must never drop a drawn child. Exact by induction over the siblings: given everything drawn before
child j, x_j ~ p_j, so one rejection-sampling step yields x_j with probability min(q_j, p_j)(x_j) and otherwise
hands on the residual, which the remaining siblings reproduce exactly, down to a final draw from the last residual.
One-hot children (deterministic candidates) are the case p_j = the point mass on x_j: accept x with probability q(x),
else q <- norm(q with x removed). They may follow drawn siblings as rows that are that point mass (a draft model's
sampled chain merged with guesses from the context): which to add may then depend on the draws before them (a guess
a draw already holds is left out), and a one-hot sibling removes nothing from a drawn one's p, which did not avoid
its token. (Placed before the draws, a guess left out for a draw that follows would make the earlier siblings
depend on a later draw, which is not exact.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def verify_greedy(
    drafted: torch.Tensor,  # [k] drafted token ids
    target_logits: torch.Tensor,  # [k + 1, vocab]: row i scores the position after drafted[:i]
) -> tuple[int, int]:
    """Greedy verification: (accepted, next token) where next is the recovered or the bonus token."""
    choice = target_logits.argmax(dim=-1)  # [k + 1]
    k = drafted.numel()
    mismatch = (choice[:k] != drafted.to(choice.device)).nonzero()
    accepted = int(mismatch[0]) if mismatch.numel() else k
    return accepted, int(choice[accepted])


def verify_sampling(
    drafted: torch.Tensor,  # [k] drafted token ids
    draft_probs: torch.Tensor | None,  # [k, vocab] p: the distributions they were drawn from; None = one-hot
    target_probs: torch.Tensor,  # [k + 1, vocab] q, already filtered (temperature, top-k, top-p, min-p)
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Rejection sampling: (accepted, next token), the next token recovered from the residual or a bonus draw."""
    k = drafted.numel()
    drafted = drafted.to(target_probs.device)
    rows = torch.arange(k, device=target_probs.device)
    q = target_probs[rows, drafted]  # [k] target probability of each drafted token
    p = torch.ones_like(q) if draft_probs is None else draft_probs[rows, drafted]  # [k]
    u = torch.rand(k, generator=generator, device=target_probs.device)
    rejected = (u * p >= q).nonzero()  # keep x when u < q(x) / p(x); written without a division by p = 0
    if not rejected.numel():
        return k, _draw(target_probs[k], generator)
    i = int(rejected[0])
    if draft_probs is None:
        residual = target_probs[i].clone()
        residual[drafted[i]] = 0.0
    else:
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:  # only reachable through rounding when q == p; q itself is then exact
        residual = target_probs[i]
    return i, _draw(residual / residual.sum(), generator)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def tree_children(parents: Sequence[int]) -> list[list[int]]:
    """children[0]: the root's children, children[1 + i]: node i's, each in index order. Checks topological order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"tree nodes must come after their parent: parents[{node}] = {parent}")
        children[parent + 1].append(node)
    return children


def guessed(draft_probs: torch.Tensor | None, node: int, token: int) -> bool:
    """Whether draft node `node` (its token `token`) is one-hot, a guess rather than a draw: a draft without
    distributions, or its row the point mass on its token."""
    return draft_probs is None or float(draft_probs[node, token]) >= 1.0


def verify_tree_greedy(
    drafted: Sequence[int],  # [k] drafted token ids, in topological order
    parents: Sequence[int],  # [k] index of each node's parent, -1 for the root's children
    target_logits: torch.Tensor,  # [k + 1, vocab]: row 0 after the last accepted token, row 1 + i after node i
) -> tuple[list[int], int]:
    """Greedy tree verification: (accepted path as node indices, next token), following the target's argmax."""
    choice = target_logits.argmax(dim=-1).tolist()  # [k + 1]
    children = tree_children(parents)
    path, row = [], 0
    while True:
        node = next((c for c in children[row] if drafted[c] == choice[row]), None)
        if node is None:
            return path, choice[row]
        path.append(node)
        row = node + 1


def verify_tree_sampling(
    drafted: Sequence[int],  # [k] drafted token ids, in topological order; siblings in the order they were drawn
    parents: Sequence[int],  # [k]
    draft_probs: torch.Tensor | None,  # [k, vocab] p: row i the distribution node i's siblings were drawn from
    target_probs: torch.Tensor,  # [k + 1, vocab] q, filtered; rows as in verify_tree_greedy
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Multi-candidate rejection sampling down the tree: (accepted path, next token recovered or bonus)."""
    children = tree_children(parents)
    path, row = [], 0
    while True:
        q = target_probs[row]  # [vocab] what the next token must follow
        tried: list[int] = []  # tokens of the rejected siblings drawn (not one-hot) before the current one
        for node in children[row]:
            token = int(drafted[node])
            if guessed(draft_probs, node, token):
                p = None  # one-hot: its own point mass
            else:
                p = draft_probs[node].clone()  # [vocab] p_j: p without the tokens drawn before
                p[tried] = 0.0
                p = p / p.sum()
                tried.append(token)
            u = float(torch.rand(1, generator=generator, device=q.device))
            if u * (1.0 if p is None else float(p[token])) < float(q[token]):
                path.append(node)
                row = node + 1
                break
            if p is None:
                residual = q.clone()
                residual[token] = 0.0
            else:
                residual = (q - p).clamp_min(0.0)
            if float(residual.sum()) > 0.0:  # zero only through rounding when q == p_j; q itself is then exact
                q = residual / residual.sum()
        else:  # every child rejected (or none): the recovered token from the residual, or the bonus token
            return path, _draw(q, generator)
