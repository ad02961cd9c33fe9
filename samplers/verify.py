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
"""

from __future__ import annotations

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
