"""The native CPU step (`decoders.models.native`): the model's own logits, the same whatever the call's rows and
tokens (so every strategy and every batch row is exact in bfloat16 too), the model's current weights at every call,
and transformers' calls wherever it cannot run."""

from __future__ import annotations

import copy
import functools
import random
import warnings

import pytest
import torch
from conftest import PROMPTS, tiny_model, tiny_tokenizer

import decoders
from decoders.models import native_check
from decoders.models.kernel import why_not_here
from evals.measure import ForwardMeter

pytestmark = pytest.mark.skipif(why_not_here() is not None, reason=f"no native step here: {why_not_here()}")

COVERED = ("llama", "qwen2")  # the tiny architectures it runs (qwen2: biased q, k, v)
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def lm_of(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> decoders.LM:
    return decoders.wrap(tiny_model(arch, seed, dtype=dtype).cpu(), tiny_tokenizer(), name=f"tiny-{arch}-{dtype}")


def logits(lm: decoders.LM, tokens: list[int], pieces: list[int]) -> torch.Tensor:
    """`tokens` scored in calls of `pieces` tokens each, on one cache: [len(tokens), vocab]."""
    cache, out, at = lm.new_cache(), [], 0
    with torch.inference_mode():
        for n in pieces:
            out.append(lm.forward(tokens[at:at + n], cache))
            at += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", COVERED)
def test_it_runs_the_covered_architectures_and_scores_as_the_model_does(arch, dtype):
    lm = lm_of(arch, dtype)
    assert lm.native is not None
    tokens = lm.encode(PROMPTS[0])
    with torch.inference_mode():
        expected = lm.model(input_ids=torch.tensor([tokens])).logits[0].float()
    got = logits(lm, tokens, [len(tokens)])
    scale = float(expected.abs().max())
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2  # (bfloat16: transformers rounds each operator's output)
    torch.testing.assert_close(got, expected, atol=tolerance * scale, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", COVERED)
def test_a_token_scores_the_same_in_a_call_of_one_or_of_many(arch, dtype):
    """Exactly: the products, norms and attention of a token do not depend on the other tokens of its call."""
    lm = lm_of(arch, dtype)
    tokens = lm.encode(PROMPTS[1] + PROMPTS[2])[:40]
    whole = logits(lm, tokens, [len(tokens)])
    rng = random.Random(1)
    for _ in range(3):
        pieces, left = [], len(tokens)
        while left:
            pieces.append(min(left, rng.choice([1, 2, 3, 5, 8, 13])))
            left -= pieces[-1]
        assert torch.equal(logits(lm, tokens, pieces), whole), pieces


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_tree_call_scores_each_node_as_its_path_does(dtype):
    lm = lm_of("llama", dtype)
    prefix, (a, b, c) = lm.encode(PROMPTS[2])[:9], (5, 7, 11)
    n = len(prefix)
    tree = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 1, 1]], dtype=torch.bool)  # a | b -> c
    cache = lm.new_cache()
    with torch.inference_mode():
        lm.forward(prefix, cache)
        nodes = lm.forward([a, b, c], cache, positions=[n, n, n + 1], tree_mask=tree)
    assert torch.equal(nodes[0], logits(lm, prefix + [a], [n + 1])[-1])
    assert torch.equal(nodes[1:], logits(lm, prefix + [b, c], [n + 2])[-2:])


@pytest.mark.parametrize("strategy", [s for s in decoders.available() if s != "guided"])
def test_every_strategy_returns_greedys_tokens_in_bfloat16(strategy):
    """Not only up to numeric ties: the verification calls score each token as greedy's one-token calls do."""
    lm = lm_of("llama", torch.bfloat16)
    draft = lm_of("llama", torch.bfloat16, seed=1)
    kind = decoders.registry.get(strategy)
    options = {"draft": draft} if kind.needs_draft or kind.takes_draft else {}
    for prompt in PROMPTS:
        greedy = decoders.generate(lm, prompt, strategy="greedy", max_new_tokens=24).tokens
        assert decoders.generate(lm, prompt, strategy=strategy, max_new_tokens=24, **options).tokens == greedy


@pytest.mark.parametrize("strategy", ["greedy", "suffix", "speculative"])
def test_each_batch_row_is_its_batch1_run_in_bfloat16(strategy):
    lm = lm_of("qwen2", torch.bfloat16)
    options = {"draft": lm_of("qwen2", torch.bfloat16, seed=1)} if strategy == "speculative" else {}
    alone = [decoders.generate(lm, p, strategy=strategy, max_new_tokens=16, **options).tokens for p in PROMPTS]
    rows = decoders.generate(lm, PROMPTS, strategy=strategy, batch_size=3, max_new_tokens=16, **options)
    assert [r.tokens for r in rows] == alone


def fresh(arch: str = "llama", dtype: torch.dtype = torch.bfloat16) -> decoders.LM:
    return decoders.wrap(copy.deepcopy(lm_of(arch, dtype).model), tiny_tokenizer(), name=f"edited-{arch}")


def edits():
    """Ways to change a model's weights after wrapping it, each (name, edit(model))."""

    def through_data(model):
        model.lm_head.weight.data.add_(0.5)  # (a LoRA merge: no version bump, the same storage)

    def copy_under_no_grad(model):
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.copy_(torch.randn_like(model.model.layers[0].mlp.up_proj.weight))

    def load_state_dict(model):
        state = {k: torch.randn_like(v) if k.endswith("q_proj.weight") else v for k, v in model.state_dict().items()}
        model.load_state_dict(state)

    def replaced_parameter(model):
        layer = model.model.layers[1].self_attn.o_proj
        layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))

    def cast(model):
        model.float()

    return [through_data, copy_under_no_grad, load_state_dict, replaced_parameter, cast]


@pytest.mark.parametrize("edit", edits(), ids=lambda f: f.__name__)
def test_a_weight_edited_after_wrapping_is_the_weight_the_next_call_reads(edit):
    lm = fresh()
    tokens = lm.encode(PROMPTS[0])
    before = logits(lm, tokens, [len(tokens)])
    torch.manual_seed(0)
    edit(lm.model)
    with torch.inference_mode():
        expected = lm.model(input_ids=torch.tensor([tokens])).logits[0].float()
    after = logits(lm, tokens, [len(tokens)])
    assert not torch.allclose(before, after)
    scale = float(expected.abs().max())
    torch.testing.assert_close(after, expected, atol=5e-2 * scale, rtol=0)


def test_a_model_moved_off_the_cpu_runs_through_transformers():
    lm = fresh()
    lm.model.to("meta")
    assert not lm.native.ready()


def test_a_forward_hook_sees_the_calls_and_decodekits_meters_do_not_stop_the_step():
    lm = fresh()
    seen = []
    handle = lm.model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    tokens = lm.encode(PROMPTS[0])
    assert not lm.native.ready()
    logits(lm, tokens, [len(tokens), ])
    assert seen  # transformers' calls ran, for the hook
    handle.remove()
    meter = ForwardMeter(lm.model, lm.device, natives=[lm.native])
    with meter:
        assert lm.native.ready()
        logits(lm, tokens, [3, len(tokens) - 3])
    assert meter.calls == 2 and meter.tokens == len(tokens)


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "phi3", "gpt2"])
def test_an_architecture_it_does_not_run_falls_back_with_one_notice(arch):
    native_check._notice.cache_clear()  # (one notice per reason and process: this test's must be the first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = decoders.wrap(tiny_model(arch).cpu(), tiny_tokenizer(), name=f"other-{arch}")
    assert lm.native is None
    assert [str(w.message) for w in caught if "native CPU step" in str(w.message)]
    greedy = decoders.generate(lm, PROMPTS[0], max_new_tokens=8)
    assert len(greedy.tokens) == 8


def test_without_a_compiler_the_model_runs_through_transformers(monkeypatch):
    native_check._notice.cache_clear()
    monkeypatch.setattr(native_check, "why_not_here", lambda dtype: "no C++ compiler found (install g++ or set CXX)")
    with pytest.warns(UserWarning, match="no C.. compiler"):
        lm = fresh()
    assert lm.native is None and not lm.static_cache_ok()
    assert len(decoders.generate(lm, PROMPTS[0], max_new_tokens=6).tokens) == 6


def test_a_probe_that_misses_keeps_transformers_calls():
    """A model of the right shape that computes something else (here: one norm's epsilon apart from the others',
    which the step does not read) is caught by the probe at wrapping."""
    native_check._notice.cache_clear()
    model = copy.deepcopy(lm_of("llama").model)
    model.model.layers[0].input_layernorm.variance_epsilon = 10.0
    with pytest.warns(UserWarning, match="probe"):
        lm = decoders.wrap(model, tiny_tokenizer(), name="odd")
    assert lm.native is None
