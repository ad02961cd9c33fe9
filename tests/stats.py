"""A chi-square goodness-of-fit test for sampled tokens, without scipy."""

import math

import torch


def chi_square_fits(draws: torch.Tensor, probs: torch.Tensor, z: float = 3.3) -> bool:
    """True unless the draws reject `probs` at about p = 0.0005 (one-sided z = 3.3).

    Tokens with an expected count below 5 are pooled into one bin; a draw of a zero-probability token always fails.
    The critical value uses the Wilson-Hilferty approximation of the chi-square quantile.
    """
    n = draws.numel()
    counts = torch.bincount(draws.cpu(), minlength=probs.numel()).double()
    probs = probs.double().cpu()
    if bool((counts[probs == 0] > 0).any()):
        return False
    expected = probs * n
    big = expected >= 5
    observed_bins = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    expected_bins = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = expected_bins > 0
    observed_bins, expected_bins = observed_bins[keep], expected_bins[keep]
    statistic = float(((observed_bins - expected_bins) ** 2 / expected_bins).sum())
    dof = max(int(keep.sum()) - 1, 1)
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return statistic < critical
