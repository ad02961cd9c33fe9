"""The static KV cache (`decoders.models.graphs`): exactly transformers' cache, on every architecture and strategy,
alone and in a batch (`BatchSlab`: each row its batch-1 greedy run's tokens, draft models' caches too).

On a CPU it runs eagerly (`cuda_graphs = True` there is the test path); with DECODEKIT_TEST_DEVICE=cuda the same tests
replay CUDA graphs of the bucketed calls.
"""

import warnings

import pytest
import torch

import conftest
import decoders
from conftest import ARCHITECTURES, PROMPTS, tiny_lm
from test_batch import LONG_PROMPT
from decoders.drafting import cost
from decoders.models import capture, graphs, slabs
from decoders.models.cache import KVCache
from decoders.models.graphs import MIN_CAPACITY, StaticKVCache
from decoders.models.quantize import self_draft


def twins(arch: str) -> tuple[decoders.LM, decoders.LM]:
    """Two LMs of one tiny model: transformers' cache, and the static one."""
    return twins_of(tiny_lm(arch))


def twins_of(base: decoders.LM) -> tuple[decoders.LM, decoders.LM]:
    """`twins` of the model of `base`."""
    dynamic, static = (decoders.wrap(base.model, base.tokenizer, name=f"{base.name}-{kind}")
                       for kind in ("dynamic", "static"))
    dynamic.cuda_graphs, static.cuda_graphs = False, True
    dynamic.native = static.native = None  # (transformers' calls on each cache; the native step has tests of its own)
    return dynamic, static


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_runs_on_the_static_cache(arch):
    _, static = twins(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        assert isinstance(static.new_cache(), StaticKVCache)


@pytest.mark.parametrize("strategy", ["greedy", "suffix", "lookahead", "prompt_lookup", "staged", "speculative",
                                      "auto"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_static_cache_gives_the_same_tokens(strategy, arch):
    dynamic, static = twins(arch)
    draft = {"staged": "draft", "speculative": "draft"}.get(strategy)
    for prompt in PROMPTS[:3]:
        outputs = []
        for lm in (dynamic, static):
            options = {"draft": tiny_lm("llama", seed=99)} if draft else {}
            outputs.append(decoders.generate(lm, prompt, strategy=strategy, max_new_tokens=40, **options).tokens)
        assert outputs[0] == outputs[1], f"{strategy} on {arch}: {prompt!r}"


def test_rollback_and_growth_continue_as_a_fresh_cache():
    """crop, keep (a tree path) and moving to a larger slab: the next call scores as transformers' cache does."""
    dynamic, static = twins("qwen2")
    ids = [(7 * i + 3) % dynamic.vocab_size for i in range(MIN_CAPACITY - 20)]
    tree = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a | b, a -> c
    with torch.inference_mode():
        caches = {lm: lm.new_cache() for lm in (dynamic, static)}
        logits = {}
        for lm, cache in caches.items():
            lm.forward(ids, cache)
            lm.forward([5, 6, 7, 8], cache)
            cache.crop(len(ids))
            lm.forward([11, 12, 13], cache, positions=[len(ids)] * 2 + [len(ids) + 1], tree_mask=tree)
            cache.keep([*range(len(ids)), len(ids), len(ids) + 2])
            logits[lm] = torch.cat([lm.forward(ids[:40], cache)])  # past the first slab's capacity
        assert isinstance(caches[static], StaticKVCache) and caches[static].slab.capacity == 2 * MIN_CAPACITY
        assert len(caches[static]) == len(caches[dynamic]) == len(ids) + 2 + 40
        torch.testing.assert_close(logits[static], logits[dynamic], rtol=1e-4, atol=1e-4)


def test_a_tree_grown_over_calls_hides_cached_nodes():
    """A [T, past + T] tree mask (a draft's tree grown over several calls) hides cached slots as on transformers'."""
    dynamic, static = twins("llama")
    prompt = [3, 5, 7, 9, 11]
    first = torch.tensor([[1, 0], [0, 1]], dtype=torch.bool)  # two siblings after the prompt
    second = torch.tensor([[1, 0, 1]], dtype=torch.bool)  # a child of the first sibling, not of the second
    with torch.inference_mode():
        got = []
        for lm in (dynamic, static):
            cache = lm.new_cache()
            lm.forward(prompt, cache)
            lm.forward([13, 17], cache, positions=[5, 5], tree_mask=first)
            wide = torch.cat([torch.ones(1, len(prompt), dtype=torch.bool), second], dim=1)
            got.append(lm.forward([19], cache, positions=[6], tree_mask=wide))
    torch.testing.assert_close(got[1], got[0], rtol=1e-4, atol=1e-4)


def test_a_slab_is_lent_to_one_live_cache_and_reused_after():
    _, static = twins("gpt2")
    first = static.new_cache()
    with torch.inference_mode():
        static.forward([1, 2, 3], first)
        second = static.new_cache()
        static.forward([4, 5], second)
    assert first.slab is not second.slab and not second.slab.capture  # the second runs eagerly, beside it
    pooled = first.slab
    del first, second
    third = static.new_cache()
    with torch.inference_mode():
        static.forward([6], third)
    assert third.slab is pooled


def test_a_cache_belongs_to_its_model():
    _, static = twins("llama")
    other = tiny_lm("llama", seed=99)
    with pytest.raises(ValueError, match="belongs to"):
        other.forward([1, 2], static.new_cache())


def test_timing_resizes_a_static_cache_without_copying():
    _, static = twins("qwen2")
    with torch.inference_mode():
        cache = static.new_cache()
        static.forward([1, 2, 3], cache)
        cache.resize(600)
        assert len(cache) == 600 and cache.slab.capacity == 4 * MIN_CAPACITY
        assert static.forward([4], cache).shape == (1, static.vocab_size)


def test_a_model_the_static_cache_cannot_run_keeps_transformers_cache():
    class Refusing(torch.nn.Module):  # a model that takes transformers' own caches only
        def __init__(self, model):
            super().__init__()
            self.inner, self.config, self.generation_config = model, model.config, model.generation_config

        def forward(self, **kwargs):
            if any(type(value).__name__ == "SlotCache" for value in kwargs.values()):
                raise NotImplementedError("no custom caches")
            return self.inner(**kwargs)

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

    base = tiny_lm("qwen2")
    lm = decoders.wrap(Refusing(base.model), base.tokenizer, name="refusing")
    lm.__dict__["cache_keyword"] = base.cache_keyword
    lm.cuda_graphs = True
    with pytest.warns(UserWarning, match="no CUDA graphs"):
        assert type(lm.new_cache()) is KVCache
    assert decoders.generate(lm, PROMPTS[0], max_new_tokens=8).tokens == \
        decoders.generate(base, PROMPTS[0], max_new_tokens=8).tokens


def test_a_call_whose_capture_fails_runs_eagerly_from_then_on(monkeypatch):
    _, static = twins("llama")
    with torch.inference_mode():
        cache = static.new_cache()
        static.forward([1, 2, 3], cache)
    slab = cache.slab
    monkeypatch.setattr(slab, "capture", True)  # (as on CUDA; the capture itself fails)
    monkeypatch.setattr(capture, "capture", lambda *_: (_ for _ in ()).throw(RuntimeError("not capturable")))
    ids, positions = torch.tensor([[4]]), torch.tensor([[3]])
    with pytest.warns(UserWarning, match="calls of 1 tokens could not be captured .*not capturable.*run eagerly"):
        assert slab.replay(static, ids, positions, 3, None, None) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tried once: no second capture, no second warning
        assert slab.replay(static, ids, positions, 3, None, None) is None


@pytest.mark.skipif(not torch.cuda.is_available() or conftest.DEVICE.type != "cuda", reason="a real CUDA capture")
def test_a_failed_capture_leaves_random_ops_and_later_captures_working(monkeypatch):
    """A capture that fails midway (here a host sync inside it) once left the device's random generator in capture
    mode: every random op after it raised "Offset increment outside graph capture" (transformers' generate_batch)."""
    _, static = twins("llama")
    with torch.inference_mode():
        cache = static.new_cache()
        static.forward([1, 2, 3], cache)
    call = graphs.Slab.call

    def syncing(self, *args):  # fine in the warm-up calls, fatal inside a capture
        torch.cuda.synchronize()
        return call(self, *args)

    monkeypatch.setattr(graphs.Slab, "call", syncing)
    with pytest.warns(UserWarning, match="calls of 1 tokens could not be captured"), torch.inference_mode():
        static.forward([4], cache)
    monkeypatch.setattr(graphs.Slab, "call", call)
    torch.rand(4, device="cuda")  # raised before
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("error")
        static.forward([5, 6], cache)  # bucket 2: captured on the same LM
    assert any(key[0] == 2 for key in cache.slab.graphs)


@pytest.mark.parametrize("strategy", ["speculative", "auto"])
def test_the_targets_int8_copy_drafts_on_its_static_cache(strategy):
    """"self:int8" drafts on the target's own cache (`SharedCacheDraft`): on a static one too, with the same tokens."""
    from decoders.drafting import draft_model
    from decoders.drafting.draft_model import SharedCacheDraft

    dynamic, static = twins("llama")
    for prompt in PROMPTS[:3]:
        want = decoders.generate(dynamic, prompt, strategy=strategy, draft="self:int8", max_new_tokens=30).tokens
        assert decoders.generate(static, prompt, strategy=strategy, draft="self:int8", max_new_tokens=30).tokens == want
    run = decoders.driver.prepare(static, PROMPTS[0], strategy="speculative", draft="self:int8", max_new_tokens=4)
    assert isinstance(run.state.cache, StaticKVCache) and isinstance(draft_model(run.state), SharedCacheDraft)


def test_a_run_reserves_the_slots_it_may_need_but_not_the_whole_context():
    from decoders.models.graphs import MAX_RESERVE

    _, static = twins("qwen2")
    with torch.inference_mode():
        short, long = static.new_cache(300), static.new_cache(10**6)
        static.forward([1, 2], short)
        del short
        static.forward([1, 2], long)
    assert long.slab.capacity == MAX_RESERVE
    assert 2 * MIN_CAPACITY in static.held.slabs  # (the short run's: 300 slots)


# ------------------------------------------------------------------------------------------------------------ batches


def static_draft() -> decoders.LM:
    return twins_of(tiny_lm("llama", seed=99))[1]


def batch_strategies() -> list[str]:
    return [s for s in decoders.available() if not decoders.registry.get(s).needs_grammar]


@pytest.mark.parametrize("strategy", batch_strategies())
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "gpt2"])
def test_a_batch_on_static_caches_gives_each_row_its_own_tokens(strategy, arch):
    """A batch's cache and its draft model's are `BatchSlab`s where the LM has a static cache: each row's tokens are
    its batch-1 greedy run's (prompts of several lengths, refills: 5 prompts through 3 rows)."""
    dynamic, static = twins(arch)
    draft = static_draft() if decoders.registry.get(strategy).needs_draft else None
    prompts = [PROMPTS[3], PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[4]]
    got = decoders.generate(static, prompts, strategy=strategy, draft=draft, batch_size=3, max_new_tokens=20)
    assert [r.tokens for r in got] == [decoders.generate(dynamic, p, max_new_tokens=20).tokens for p in prompts]
    assert static.held.batch_slabs
    assert draft is None or draft.held.batch_slabs
    if static.device.type == "cuda":  # (the test device): the calls replayed graphs
        assert any(graph not in (None, False) for slab in static.held.batch_slabs.values()
                   for graph, _, _ in slab.graphs.values())


@pytest.mark.parametrize("kind", ["self:int8", "translated"])
def test_a_batchs_int8_copy_and_translated_draft_draft_on_static_caches_of_their_own(kind):
    from test_batch import translating_draft

    dynamic, static = twins("llama")
    if kind == "self:int8":
        draft = self_draft(static, "int8")
        draft.cuda_graphs = True
    else:
        draft = twins_of(translating_draft())[1]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[4]]
    got = decoders.generate(static, prompts, strategy="speculative", draft=draft, batch_size=3, max_new_tokens=20)
    assert [r.tokens for r in got] == [decoders.generate(dynamic, p, max_new_tokens=20).tokens for p in prompts]
    assert sum(r.stats.draft_calls for r in got) > 0 and draft.held.batch_slabs


@pytest.fixture
def failing_captures(monkeypatch):
    """Batch slabs that capture (as on CUDA), every capture failing: calls padded to the buckets, run eagerly."""
    init = slabs.BatchSlab.__init__

    def capturing(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.capture = True

    monkeypatch.setattr(slabs.BatchSlab, "__init__", capturing)
    monkeypatch.setattr(capture, "capture", lambda *_: (_ for _ in ()).throw(RuntimeError("not capturable")))


@pytest.mark.parametrize("strategy", ["greedy", "speculative", "suffix", "lookahead"])
def test_a_batchs_calls_padded_to_a_graphs_width_score_as_unpadded(failing_captures, strategy):
    dynamic, static = twins("qwen2")
    draft = static_draft() if strategy == "speculative" else None
    prompts = [PROMPTS[3], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = decoders.generate(static, prompts, strategy=strategy, draft=draft, batch_size=2, max_new_tokens=24)
    assert any("batch calls of 2 x 1 tokens could not be captured" in str(w.message) for w in caught)
    assert [r.tokens for r in got] == [decoders.generate(dynamic, p, max_new_tokens=24).tokens for p in prompts]
    widths = {key[0] for slab in static.held.batch_slabs.values() for key in slab.graphs}
    assert widths <= set(graphs.BUCKETS) and (strategy == "greedy") == (widths == {1})


def test_a_batch_outgrowing_its_slab_moves_to_a_larger_one_and_scores_the_same():
    dynamic, static = twins("llama")
    prompts = [LONG_PROMPT, PROMPTS[0], LONG_PROMPT[::-1]]  # (slots grow with each call: past 256 before compacting)
    got = decoders.generate(static, prompts, batch_size=2, max_new_tokens=120)
    assert [r.tokens for r in got] == [decoders.generate(dynamic, p, max_new_tokens=120).tokens for p in prompts]
    assert {capacity for _, capacity in static.held.batch_slabs} == {MIN_CAPACITY, 2 * MIN_CAPACITY}
