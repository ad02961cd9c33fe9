"""The public surface: registry, streaming, stop strings, and a clear error for every kind of bad input."""

import pytest
import torch

import decoders
from conftest import PROMPTS, tiny_lm


def test_available_lists_the_builtin_strategies():
    assert "greedy" in decoders.available()
    assert decoders.available() == sorted(decoders.available())


def test_unknown_strategy_lists_names_and_suggests_the_nearest():
    with pytest.raises(ValueError) as error:
        decoders.generate(tiny_lm("llama"), PROMPTS[0], strategy="greedyy")
    assert "Did you mean 'greedy'?" in str(error.value)
    assert "Known strategies: " + ", ".join(decoders.available()) in str(error.value)


def test_register_a_new_strategy_and_a_taken_name_raises():
    @decoders.register("test_echo_greedy")
    class EchoGreedy(decoders.Decoder):
        """Greedy written as a user would, in their own file."""

        def step(self, state):
            state.accept([state.choose(state.score()[-1])], ["target"])

    try:
        assert "test_echo_greedy" in decoders.available()
        lm = tiny_lm("gpt2")
        ours = decoders.generate(lm, PROMPTS[3], strategy="test_echo_greedy", max_new_tokens=12)
        assert ours.tokens == decoders.generate(lm, PROMPTS[3], max_new_tokens=12).tokens
        with pytest.raises(ValueError, match="already taken"):
            @decoders.register("greedy")
            class Impostor(decoders.Decoder):
                pass
    finally:
        decoders.unregister("test_echo_greedy")
    assert "test_echo_greedy" not in decoders.available()


def test_a_decoder_instance_is_accepted_and_unknown_options_are_named():
    lm = tiny_lm("llama")
    greedy = decoders.registry.get("greedy")()
    assert decoders.generate(lm, PROMPTS[0], strategy=greedy, max_new_tokens=4).strategy == "greedy"
    with pytest.raises(TypeError, match="unknown option"):
        decoders.generate(lm, PROMPTS[0], strategy="greedy", k=3)


def test_stream_yields_what_generate_returns():
    lm = tiny_lm("phi3")
    chunks = list(decoders.stream(lm, PROMPTS[1], max_new_tokens=15))
    result = decoders.generate(lm, PROMPTS[1], max_new_tokens=15)
    assert [t for c in chunks for t in c.tokens] == result.tokens
    assert "".join(c.text for c in chunks) == result.text
    assert [s for c in chunks for s in c.sources] == result.sources
    assert not torch.is_inference_mode_enabled()  # no leak into the consumer between chunks


def test_stop_string_ends_at_the_token_that_completes_it():
    lm = tiny_lm("llama")
    free = decoders.generate(lm, PROMPTS[0], max_new_tokens=30)
    stop = lm.decode(free.tokens[:8])[-3:]  # a string that first appears by the 8th token
    result = decoders.generate(lm, PROMPTS[0], max_new_tokens=30, stop=stop)
    assert result.finish_reason == "stop"
    assert stop in result.text and stop not in lm.decode(result.tokens[:-1])
    assert result.tokens == free.tokens[: len(result.tokens)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt=torch.tensor([], dtype=torch.long)), "prompt is empty"),  # ([]: a list of no prompts)
        (dict(prompt=[1, 99999]), "token ids must be integers"),
        (dict(max_new_tokens=0), "max_new_tokens must be"),
        (dict(max_new_tokens=-3), "max_new_tokens must be"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be"),
        (dict(prompt=[5] * 250, max_new_tokens=10), "exceeds the model's context of 256"),
        (dict(temperature=-0.5), "temperature"),
        (dict(stop=[""]), "stop strings"),
        (dict(temperature=1.0, seed="x"), "seed must be a whole number"),
        (dict(temperature=1.0, seed=2**70), "seed must be a whole number"),
    ],
)
def test_bad_input_gets_a_clear_error(kwargs, message):
    kwargs = {"prompt": PROMPTS[0], **kwargs}
    with pytest.raises(ValueError, match=message):
        decoders.generate(tiny_lm("llama"), kwargs.pop("prompt"), **kwargs)


def test_numpy_integers_count_as_whole_numbers():
    lm, numpy = tiny_lm("llama"), pytest.importorskip("numpy")
    want = decoders.generate(lm, PROMPTS[0], max_new_tokens=3, temperature=1.0, seed=5).tokens
    assert decoders.generate(lm, PROMPTS[0], max_new_tokens=numpy.int64(3), temperature=1.0,
                             seed=numpy.int32(5)).tokens == want


def test_load_rejects_bad_names_clearly(tmp_path):
    with pytest.raises(ValueError, match="unknown dtype"):
        decoders.load(str(tmp_path), dtype="float8")
    with pytest.raises(OSError, match="could not load model"):
        decoders.load(str(tmp_path))  # an empty folder


def test_load_a_saved_folder_roundtrip(tmp_path):
    lm = tiny_lm("qwen2")
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    loaded = decoders.load(str(tmp_path), dtype="float32", device="cpu")
    assert loaded.dtype == torch.float32 and loaded.eos_token_ids == lm.eos_token_ids
    want = decoders.generate(lm, PROMPTS[4], max_new_tokens=10).tokens
    assert decoders.generate(loaded, PROMPTS[4], max_new_tokens=10).tokens == want


def test_strategies_register_through_the_entry_point_group(monkeypatch):
    """A package's `decodekit.strategies` entry point is imported on first use; a broken one only warns."""
    from decoders import registry

    class Point:
        def __init__(self, name, load):
            self.name, self.value, self.load = name, f"plugin:{name}", load

    def load_good():
        @decoders.register("test_plugin_greedy")
        class PluginGreedy(decoders.Decoder):
            def step(self, state):
                state.accept([state.choose(state.score()[-1])], ["target"])

    def load_broken():
        raise ImportError("missing dependency")

    seen = []
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    monkeypatch.setattr(registry, "entry_points",
                        lambda group: seen.append(group) or [Point("good", load_good), Point("bad", load_broken)])
    try:
        with pytest.warns(UserWarning, match="could not load strategy plugin 'bad'"):
            names = decoders.available()
        assert seen == ["decodekit.strategies"] and "test_plugin_greedy" in names
        assert decoders.available() == names and seen == ["decodekit.strategies"]  # loaded once
    finally:
        decoders.unregister("test_plugin_greedy")


def test_proposer_is_public_and_the_builtin_proposers_implement_it():
    from decoders.proposers import draft_chain, draft_tree, lookahead, merged, suffix

    assert "Proposer" in decoders.__all__
    protocol = {name for name in vars(decoders.Proposer) if name in ("offer", "draft", "learn")}
    assert protocol == {"offer", "draft", "learn"}
    for cls in (draft_chain.ChainProposer, draft_tree.TreeProposer, lookahead.LookaheadProposer,
                merged.MergedProposer, suffix.SuffixProposer):
        assert all(callable(getattr(cls, name, None)) for name in protocol), cls
