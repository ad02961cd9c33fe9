"""Verifiers without a model: hand-built logits for greedy, draw counts for rejection sampling."""

import pytest
import torch

from samplers import make_generator
from samplers.verify import verify_greedy, verify_sampling
from stats import chi_square_fits

VOCAB = 6


def logits_preferring(*tokens):
    """[len(tokens), VOCAB] logits whose argmax at row i is tokens[i]."""
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_perfect_match_takes_the_bonus_token():
    assert verify_greedy(torch.tensor([1, 2, 3]), logits_preferring(1, 2, 3, 4)) == (3, 4)


def test_greedy_early_mismatch_recovers_the_target_token():
    assert verify_greedy(torch.tensor([1, 5, 3]), logits_preferring(1, 2, 3, 4)) == (1, 2)
    assert verify_greedy(torch.tensor([0, 2, 3]), logits_preferring(1, 2, 3, 4)) == (0, 1)


def test_greedy_empty_draft_is_a_plain_greedy_step():
    assert verify_greedy(torch.tensor([], dtype=torch.long), logits_preferring(4)) == (0, 4)


def test_sampling_with_the_target_as_draft_accepts_everything():
    q = torch.softmax(torch.randn(4, VOCAB), -1)
    accepted, _ = verify_sampling(torch.tensor([0, 1, 2]), q[:3], q, make_generator(0))
    assert accepted == 3


def test_sampling_never_accepts_a_token_the_target_rules_out():
    q = torch.softmax(torch.randn(2, VOCAB), -1)
    q[0, 3] = 0.0
    q = q / q.sum(-1, keepdim=True)
    for seed in range(50):
        accepted, token = verify_sampling(torch.tensor([3]), None, q, make_generator(seed))
        assert accepted == 0 and token != 3


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_reproduces_the_target_distribution(one_hot):
    """The first new token (accepted draft or recovered) over many seeded draws follows q, not p."""
    torch.manual_seed(0)
    q = torch.softmax(torch.randn(2, VOCAB) * 1.5, -1)  # [k + 1, vocab] target
    p = torch.softmax(torch.randn(1, VOCAB) * 1.5, -1)  # [k, vocab] a deliberately different draft
    generator = make_generator(1)
    firsts = []
    for _ in range(6000):
        if one_hot:  # a drafter without a distribution always proposes token 2
            accepted, token = verify_sampling(torch.tensor([2]), None, q, generator)
            drafted = 2
        else:
            drafted = int(torch.multinomial(p[0], 1, generator=generator))
            accepted, token = verify_sampling(torch.tensor([drafted]), p, q, generator)
        firsts.append(drafted if accepted else token)
    firsts = torch.tensor(firsts)
    assert chi_square_fits(firsts, q[0])
    assert not chi_square_fits(firsts, p[0] if not one_hot else torch.nn.functional.one_hot(torch.tensor(2), VOCAB))


def test_rejection_sampling_second_position_follows_the_target():
    """With two drafted tokens, the second new token also follows q given an accepted first token."""
    q = torch.softmax(torch.tensor([[4.0, 0, 0, 0, 0, 0], [0.5, 1.0, 0.2, 0.0, -1.0, 0.3], [0.0] * 6]), -1)
    p = torch.softmax(torch.tensor([[4.0, 0, 0, 0, 0, 0], [2.0, -1.0, 0.0, 1.0, 0.0, 0.0]]), -1)
    generator = make_generator(5)
    seconds = []
    while len(seconds) < 5000:
        first = int(torch.multinomial(p[0], 1, generator=generator))
        second = int(torch.multinomial(p[1], 1, generator=generator))
        accepted, token = verify_sampling(torch.tensor([first, second]), p, q, generator)
        if accepted >= 1 and first == 0:  # condition on the first token being 0
            seconds.append(second if accepted == 2 else token)
    assert chi_square_fits(torch.tensor(seconds), q[1])
