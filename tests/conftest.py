"""Shared fixtures: an in-memory byte-level tokenizer and tiny random causal LMs of several architectures."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the model hub
if "DECODEKIT_CALIBRATION" not in os.environ:  # auto's cost calibrations of tiny test models go to a throwaway
    # folder, not the user's cache, removed when the run ends (a folder per run was left behind in the system's temp)
    CALIBRATION = tempfile.TemporaryDirectory(prefix="decodekit-calibration-")
    os.environ["DECODEKIT_CALIBRATION"] = CALIBRATION.name

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as tokenizer_decoders

import decoders

# Tiny models run fastest on one thread, and a busy 2-core machine makes two threads fight.
torch.set_num_threads(1)
# Every test that builds a model puts it here, so the same suite runs on a GPU unchanged.
DEVICE = torch.device(os.environ.get("DECODEKIT_TEST_DEVICE", "cpu"))
INSTALLED = any(True for _ in importlib.metadata.distributions(name="decodekit"))  # not only on the path

VOCAB = 384
CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. A tensor is a multi-dimensional array of numbers.",
    "Index: A B C D E F G H I J K L M N O P Q R S T U V W X Y Z",
    "The digits of Pi are 3.14159265358979323846264338327950288419716939937510",
    '{"name": "clerame", "age": 7, "armor": "plate", "weapon": "mace", "strength": 4171}',
]
PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "Index: A B C",
    "The digits of Pi are 3.14159",
    '{"name": "',
]


@functools.cache
def tiny_tokenizer():
    """A byte-level BPE tokenizer trained in memory (no hub), with <eos> as id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizer_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
_DECODER = dict(max_position_embeddings=256, eos_token_id=0, bos_token_id=0, pad_token_id=0)
# name -> (config class, model class, config kwargs). Mistral and Gemma3 get a short sliding window on purpose.
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_SMALL, **_DECODER, num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_SMALL, **_DECODER, num_key_value_heads=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_SMALL, **_DECODER, num_key_value_heads=2, sliding_window=8)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_SMALL, **_DECODER, num_key_value_heads=1, head_dim=16)),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(_SMALL, **_DECODER, num_key_value_heads=1, head_dim=16, sliding_window=8,
             layer_types=["sliding_attention", "full_attention"]),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_SMALL, **_DECODER, num_key_value_heads=2)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, eos_token_id=0, bos_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_SMALL, **_DECODER)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                 word_embed_proj_dim=64, max_position_embeddings=256, eos_token_id=0, bos_token_id=0, pad_token_id=1)),
}


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny random transformers model of `arch`.

    A wide init keeps argmax near-ties rare; untied embeddings keep Gemma-style models (which scale the input
    embedding up) from just repeating their input token.
    """
    config_name, model_name, kwargs = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(**kwargs, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(DEVICE, dtype).eval()
    model.generation_config.eos_token_id = 0
    model.generation_config.pad_token_id = 0
    return model


def on_device(model):
    """A model built in a test, moved to the test device and put in evaluation mode."""
    return model.to(DEVICE).eval()


@functools.cache
def tiny_lm(arch: str, seed: int = 0) -> decoders.LM:
    """A cached tiny `LM` (model + in-memory tokenizer)."""
    return decoders.wrap(tiny_model(arch, seed), tiny_tokenizer(), name=f"tiny-{arch}-{seed}")


@functools.cache
def transformers_lm(arch: str, seed: int = 0) -> decoders.LM:
    """`tiny_lm` on transformers' calls, never the native step (`decoders.models.native`): for tests whose choices
    lean on the cost of a call being about the same whatever its tokens, as a tiny model's is there (per-call
    overhead), not on the native step, where a tiny model's call costs in proportion to its tokens."""
    lm = decoders.wrap(tiny_model(arch, seed), tiny_tokenizer(), name=f"tiny-{arch}-{seed}-transformers")
    lm.native = None
    return lm


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Llama and the in-memory tokenizer, saved like any local model folder (a test module may define
    its own)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)
