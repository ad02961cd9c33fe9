"""Probes, run once per `LM`: whether its calls score a token tree under a custom mask, and on a `StaticKVCache`."""

from __future__ import annotations

import torch

from decoders.models.cache import KVCache
from decoders.models.graphs import StaticKVCache
from decoders.models.int8 import row_by_row


def probe_tree_mask(lm) -> bool | str:
    """True if a tree-masked call scores each node of a 2-branch tree as causal calls do, else what went wrong. An int8
    copy rounds each row alone meanwhile (`int8.row_by_row`), else its rows would skew each other."""
    prefix = [i % lm.vocab_size for i in (3, 5, 7, 11)]
    a, b, c = (i % lm.vocab_size for i in (13, 17, 19))
    tree = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 1, 1]], dtype=torch.bool)  # a | b -> c
    with row_by_row(lm.model), torch.inference_mode():
        cache = lm.new_cache()
        try:
            lm.forward(prefix, cache)
            tree_logits = lm.forward([a, b, c], cache, positions=[4, 4, 5], tree_mask=tree).float()
        except Exception as error:  # noqa: BLE001 - any failure means "no tree masks", reported to the user
            return f"raised {type(error).__name__}: {error}"

        def chain(tokens: list[int]) -> torch.Tensor:  # [3, vocab]: `tokens` after the prefix, causally
            cache.crop(len(prefix))
            return lm.forward(tokens, cache).float()

        expected = torch.stack([chain([a, b, c])[0], *chain([b, c, a])[:2]])  # a; b then c
    # relative to the logits' scale, far below the share of it an ignored mask moves them by
    tolerance = (1e-3 if lm.dtype == torch.float32 else 1e-2) * float(expected.abs().max())
    if not torch.allclose(tree_logits, expected, atol=tolerance, rtol=0):
        return "ignores a custom attention mask"
    return True


def probe_static_cache(lm) -> bool | str:
    """True if a prompt, a chain and a tree call score on a `StaticKVCache` as on a `KVCache`, else what went wrong."""
    prompt, chain = [i % lm.vocab_size for i in (3, 5, 7, 11, 13)], [i % lm.vocab_size for i in (17, 19)]
    tree = torch.tensor([[1, 0], [0, 1]], dtype=torch.bool)  # two siblings
    outputs = []
    with torch.inference_mode():
        for cache in (KVCache(), StaticKVCache(lm)):
            try:
                outputs.append(
                    torch.cat(
                        [
                            lm.forward(prompt, cache),
                            lm.forward(chain, cache),
                            lm.forward(chain, cache, positions=[7, 7], tree_mask=tree),
                        ]
                    ).float()
                )
            except Exception as error:  # noqa: BLE001 - any failure means "no static cache", reported to the user
                return f"raised {type(error).__name__}: {error}"
    expected, static = outputs
    tolerance = (1e-3 if lm.dtype == torch.float32 else 3e-2) * float(expected.abs().max())
    if not torch.allclose(static, expected, atol=tolerance, rtol=0):
        return f"scores differently (by {float((static - expected).abs().max()):.3g})"
    return True
