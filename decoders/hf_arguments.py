"""What `custom_generate` (`decoders.hf`) takes from a `generate` call's arguments, and what it refuses by name."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation import (
    LogitNormalization,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# the logits warpers decodekit's sampling reproduces, in the order both apply them, and the setting each carries
_WARPERS = (
    (TemperatureLogitsWarper, "temperature"),
    (TopKLogitsWarper, "top_k"),
    (TopPLogitsWarper, "top_p"),
    (MinPLogitsWarper, "min_p"),
)
# the generate argument that adds each processor, named in the error that refuses it
_PROCESSOR_ARGUMENTS = {
    "RepetitionPenaltyLogitsProcessor": "repetition_penalty",
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
    "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size",
    "EncoderNoRepeatNGramLogitsProcessor": "encoder_no_repeat_ngram_size",
    "NoBadWordsLogitsProcessor": "bad_words_ids",
    "SequenceBiasLogitsProcessor": "sequence_bias",
    "MinLengthLogitsProcessor": "min_new_tokens / min_length",  # transformers turns min_new_tokens into min_length
    "MinNewTokensLengthLogitsProcessor": "min_new_tokens",
    "PrefixConstrainedLogitsProcessor": "prefix_allowed_tokens_fn",
    "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
    "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id",
    "InfNanRemoveLogitsProcessor": "remove_invalid_values",
    "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
    "SuppressTokensLogitsProcessor": "suppress_tokens",
    "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "ClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "TypicalLogitsWarper": "typical_p",
    "EpsilonLogitsWarper": "epsilon_cutoff",
    "EtaLogitsWarper": "eta_cutoff",
    "TopHLogitsWarper": "top_h",
    "HammingDiversityLogitsProcessor": "diversity_penalty",
    "WatermarkLogitsProcessor": "watermarking_config",
    "SynthIDTextWatermarkLogitsProcessor": "watermarking_config",
}
# generation-config fields of other decoding modes or outputs decodekit does not produce -> the values allowed
_UNSUPPORTED_FIELDS = {
    **dict.fromkeys(("num_beams", "num_beam_groups", "num_return_sequences"), (None, 1)),
    "penalty_alpha": (None, 0, 0.0),
    **dict.fromkeys(("dola_layers", "prompt_lookup_num_tokens", "assistant_early_exit"), (None,)),
    **dict.fromkeys(
        ("token_healing", "output_scores", "output_logits", "output_attentions", "output_hidden_states"), (None, False)
    ),
}
_CACHE_INPUTS = ("cache", "past_key_values")  # generate's KV cache input: `cache` from transformers 5.24 on


def pad_id(generation_config: GenerationConfig) -> int:
    """What transformers pads a batch's finished rows with: pad_token_id, else the first EOS id."""
    pad = generation_config.pad_token_id
    if pad is None and generation_config.eos_token_id is not None:
        pad = torch.as_tensor(generation_config.eos_token_id).reshape(-1)[0]
    if pad is None:
        raise ValueError("a batch of prompts needs pad_token_id= (or an eos_token_id) to pad the rows that end first")
    return int(pad)


def sampling_settings(generation_config: GenerationConfig, processors: list) -> dict:
    """decodekit's sampling settings from the logits warpers (greedy unless do_sample); other processors are refused."""
    settings: dict[str, Any] = {
        "temperature": 1.0 if generation_config.do_sample else 0.0,
        "top_k": None,
        "top_p": None,
        "min_p": None,
    }
    last = -1
    for processor in processors:
        name = type(processor).__name__
        index = next((i for i, (cls, _) in enumerate(_WARPERS) if type(processor) is cls), None)
        if index is None:
            if isinstance(processor, LogitNormalization):
                continue  # renormalize_logits: a log-softmax leaves the distribution as it is
            argument = _PROCESSOR_ARGUMENTS.get(name)
            cause = f"{argument} (adds {name})" if argument else f"logits_processor=[{name}(...)]"
            raise ValueError(
                f"{cause} is not supported by decodekit's custom_generate: its strategies sample from "
                "the model's distribution after temperature, top_k, top_p and min_p only; drop it"
            )
        if (
            index <= last
            or getattr(processor, "min_tokens_to_keep", 1) != 1
            or getattr(processor, "filter_value", float("-inf")) != float("-inf")
        ):
            raise ValueError(
                f"logits_processor: {name} as given is not supported by decodekit's custom_generate: "
                "temperature, top_k, top_p and min_p apply once each, in that order, dropping tokens "
                "to -inf and keeping at least one; set them as generate arguments instead"
            )
        last = index
        if generation_config.do_sample:  # in greedy mode a warper never changes the argmax
            field = _WARPERS[index][1]
            settings[field] = getattr(processor, field)
    return settings


def _left_padding(mask: torch.Tensor) -> torch.Tensor:
    """The [B, T] bool mask of each row's own tokens from a left-padding `attention_mask`; anything else raises."""
    kept = mask.to(torch.bool).cpu()
    counts = kept.sum(1)
    left = torch.arange(kept.shape[1])[None, :] >= (kept.shape[1] - counts)[:, None]  # zeros first, then ones
    if not torch.equal(kept, left) or bool((counts == 0).any()):
        raise ValueError(
            "attention_mask with right padding (or zeros between ones, or an empty row) is not supported "
            "by decodekit's custom_generate: pad prompts on the left (tokenizer padding_side='left'), as "
            "transformers' generate expects"
        )
    return kept


def check_call(input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict) -> torch.Tensor:
    """Refuse, naming the argument, what decodekit cannot honor; returns the prompts' own tokens ([B, T] bool)."""
    for field, allowed in _UNSUPPORTED_FIELDS.items():  # first: beams and return sequences also widen the batch
        value = getattr(generation_config, field, None)
        if value not in allowed:
            raise ValueError(
                f"{field}={value!r} is not supported by decodekit's custom_generate "
                f"(it runs one decodekit strategy and returns sequences and decodekit_stats); drop it"
            )
    mask = model_kwargs.get("attention_mask")
    kept = torch.ones(input_ids.shape, dtype=torch.bool) if mask is None else _left_padding(mask)
    for name, value in model_kwargs.items():
        if value is None or name in ("use_cache", "logits_to_keep", "cache_position", "attention_mask"):
            continue
        if (
            name == "position_ids"
            and value.numel() == input_ids.numel()
            and all(
                torch.equal(row[keep], torch.arange(int(keep.sum())))
                for row, keep in zip(value.reshape(input_ids.shape).cpu(), kept)
            )
        ):
            continue
        if name in _CACHE_INPUTS and getattr(value, "get_seq_length", lambda: 1)() == 0:
            continue  # the empty cache transformers made
        why = {
            "position_ids": "position_ids other than 0..n-1 over each prompt's own tokens",
            **{cache: f"a prefilled {cache} cache" for cache in _CACHE_INPUTS},
        }.get(name, f"the model input {name}=")
        raise ValueError(
            f"{why} is not supported by decodekit's custom_generate: it decodes the prompts of "
            "input_ids (left padding dropped by attention_mask), from scratch"
        )
    return kept
