"""decodekit inside `model.generate`: `custom_generate` runs a registered strategy as transformers' decoding loop.

    out = model.generate(**inputs, custom_generate=custom_generate, strategy="staged", assistant_model=draft)

Honoured: the generation config's length, EOS ids and sampling warpers, stopping_criteria, a streamer,
`assistant_model=` (or `draft=`), `return_dict_in_generate` and a left-padded batch; anything else is refused by name.
transformers 5.x drops `tokenizer=` before calling a callable `custom_generate`, so `grammar=` and `stop_strings=` need
the exported folder (`hub_generate`).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation import GenerateDecoderOnlyOutput, StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerationMixin

from decoders import registry
from decoders.base import Decoder, Result
from decoders.capabilities import check_request
from decoders.driver import _run_batch, prepare, resolve_draft
from decoders.hf_arguments import check_call, pad_id, sampling_settings
from decoders.models.attention import restored
from decoders.models.lm import LM

_OWN_ARGUMENTS = ("strategy", "draft", "seed", "grammar", "tokenizer")  # besides the strategies' options


@dataclass
class DecodekitOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the decodekit run's statistics (`return_dict_in_generate=True`)."""

    decodekit_stats: dict | None = None  # Stats.as_dict() + "strategy", "finish_reason", "sources" (one per new token)


class TokenIds:
    """An ids-only stand-in for a tokenizer, for runs that never need text: no vocabulary, and it decodes to ""."""

    eos_token_id = None

    def __call__(self, text: str, **kwargs):
        raise TypeError(
            "this run has no tokenizer (transformers does not pass tokenizer= to a custom_generate "
            "callable); give token ids, not text"
        )

    def get_vocab(self) -> dict[str, int]:
        return {}

    def decode(self, tokens, skip_special_tokens: bool = False) -> str:
        return ""


class CustomGenerate:
    """transformers' `custom_generate` callable running a decodekit strategy. Its signature (transformers reads it
    to tell our keyword arguments) lists our own arguments and every registered strategy's options."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer  # a tokenizer handed over outside the call (the exported folder's path)

    @property
    def __signature__(self) -> inspect.Signature:
        _, *named, rest = inspect.signature(CustomGenerate.__call__).parameters.values()  # (self, model, ..., **kwargs)
        keyword = inspect.Parameter.KEYWORD_ONLY
        ours = [
            inspect.Parameter("strategy", keyword, default="greedy"),
            *(inspect.Parameter(name, keyword, default=None) for name in (*_OWN_ARGUMENTS[1:], *_option_names())),
        ]
        named = [p.replace(annotation=inspect.Parameter.empty) for p in named]
        return inspect.Signature([*named, *ours, rest.replace(name="model_kwargs")])

    def __call__(
        self,
        model,
        input_ids: torch.Tensor,
        logits_processor=None,
        stopping_criteria=None,
        generation_config: GenerationConfig | None = None,
        synced_gpus: bool = False,
        streamer=None,
        assistant_model=None,
        **kwargs,
    ) -> torch.Tensor | DecodekitOutput:
        """Run `strategy` on a prepared `generate` call and return what `generate` returns."""
        if generation_config is None:
            raise TypeError(
                "decoders.hf.custom_generate is called by model.generate: "
                "model.generate(**inputs, custom_generate=custom_generate, strategy=...)"
            )
        if synced_gpus:
            raise ValueError("synced_gpus=True is not supported by decodekit's custom_generate (one process)")
        options = {name: kwargs.pop(name) for name in _option_names() if name in kwargs}
        strategy = kwargs.pop("strategy", "greedy")
        draft, seed, grammar, tokenizer = (kwargs.pop(name, None) for name in _OWN_ARGUMENTS[1:])
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        call_streamer, call_assistant = _generate_call_arguments(model)
        streamer = streamer if streamer is not None else call_streamer
        assistant_model = assistant_model if assistant_model is not None else call_assistant
        kept = check_call(input_ids, generation_config, kwargs)  # [B, T] bool: the prompts' own tokens
        if input_ids.shape[0] > 1 and streamer is not None:
            raise ValueError(
                f"streamer= with a batch of {input_ids.shape[0]} prompts is not supported by decodekit's "
                "custom_generate: its rows advance at their own pace, not one token per row per step; "
                "stream one prompt at a time, or use decoders.stream(lm, prompts)"
            )
        sampling = sampling_settings(generation_config, list(logits_processor or ()))
        if sampling["temperature"] and seed is None:
            seed = int(torch.randint(0, 2**62, ()))  # from torch's global RNG, as transformers samples
        if grammar is not None and tokenizer is None:
            raise ValueError(
                "grammar= needs the tokenizer, which transformers does not pass to a custom_generate "
                "callable: export a folder (decodekit export-hub DIR) and call model.generate(..., "
                "custom_generate='DIR', trust_remote_code=True, tokenizer=tok, grammar=...), or use "
                "decoders.generate"
            )
        with restored(model, assistant_model):  # LM sets eval mode and may switch the attention
            lm, draft = _models(model, tokenizer, generation_config, assistant_model, draft)
            try:
                check_request(
                    strategy if isinstance(strategy, Decoder) else registry.get(strategy),
                    has_draft=draft is not None,
                    has_grammar=grammar is not None,
                )
            except ValueError as error:
                raise ValueError(f"{error} (in model.generate, the draft model is assistant_model=)") from error
            prompts = [row[keep.to(row.device)].tolist() for row, keep in zip(input_ids, kept)]
            arguments = dict(
                strategy=strategy,
                max_new_tokens=generation_config.max_length - input_ids.shape[1],
                draft=draft,
                seed=seed,
                grammar=grammar,
                **sampling,
                **options,
            )
            one = len(prompts) == 1
            pad = 0 if one else pad_id(generation_config)  # raises before any run where a batch has none
            if one:  # a criterion that fires ends the run
                run = prepare(lm, prompts[0], **arguments)
                events = ((0, chunk, None) for chunk in run.chunks(with_text=False))
            else:  # every row decoded to its end: the rows share their calls
                events = _run_batch(lm, prompts, batch_size=len(prompts), with_text=False, **arguments)
            new, results = _emitted(events, input_ids, stopping_criteria, streamer, until_stopped=one)
            results = [run.result()] if one else results
            for index, result in enumerate(results):
                if result.error is not None:
                    raise RuntimeError(f"row {index} of the batch: {result.error}")
            sequences = _padded(input_ids, new, pad)
        if not generation_config.return_dict_in_generate:
            return sequences
        stats = [_row_stats(result, len(tokens)) for result, tokens in zip(results, new)]
        return DecodekitOutput(sequences=sequences, decodekit_stats=stats[0] if len(stats) == 1 else stats)


custom_generate = CustomGenerate()


def hub_generate(model, *args, **kwargs) -> torch.Tensor | DecodekitOutput:
    """The `generate` of an exported custom_generate folder (`evals.export_hub`): runs transformers' raw arguments
    through `generate`'s usual preparation with `custom_generate`, keeping the tokenizer that path would drop."""
    tokenizer = kwargs.pop("tokenizer", None)
    stop_strings = kwargs.pop("stop_strings", None)
    if stop_strings is not None:  # transformers builds this criterion only with the tokenizer it drops
        if tokenizer is None:
            raise ValueError("stop_strings= needs tokenizer= in the same generate call")
        given = kwargs.get("stopping_criteria") or ()
        kwargs["stopping_criteria"] = StoppingCriteriaList([*given, StopStringCriteria(tokenizer, stop_strings)])
    # GenerationMixin.generate, not model.generate: a model loaded with this folder has its generate replaced by us
    return GenerationMixin.generate(model, *args, custom_generate=CustomGenerate(tokenizer), **kwargs)


def _option_names() -> list[str]:
    """Every option of every registered strategy that can be a `generate` keyword (a generation-config field cannot)."""
    defaults = GenerationConfig()
    names = {field.name for name in registry.available() for field in dataclasses.fields(registry.get(name).Options)}
    return sorted(n for n in names if n not in _OWN_ARGUMENTS and not hasattr(defaults, n))


_GENERATE_CODE = inspect.unwrap(GenerationMixin.generate).__code__


def _generate_call_arguments(model) -> tuple[Any, Any]:
    """(streamer, assistant_model) of the innermost `GenerationMixin.generate` running for `model`, read from its
    frame: transformers 5.x never passes them to a callable `custom_generate`."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _GENERATE_CODE and frame.f_locals.get("self") is model:
            return frame.f_locals.get("streamer"), frame.f_locals.get("assistant_model")
        frame = frame.f_back
    return None, None


def _row_stats(result: Result, new: int) -> dict:
    """A row's `decodekit_stats` for the `new` tokens the output kept (finish reason "stop" if a criterion cut it)."""
    result.stats.new_tokens = new
    whole_run = result.finish_reason is not None and new == len(result.tokens)
    return {
        **result.stats.as_dict(),
        "strategy": result.strategy,
        "finish_reason": result.finish_reason if whole_run else "stop",
        "sources": result.sources[:new],
    }


def _models(model, tokenizer, generation_config: GenerationConfig, assistant_model, draft) -> tuple[LM, LM | None]:
    """The target `LM`, ending at the EOS ids this call resolved, and the draft `LM` (or None)."""
    lm = LM(model, tokenizer if tokenizer is not None else TokenIds())
    eos = generation_config.eos_token_id  # an id, a list of ids or None, the model's config merged in
    lm.eos_token_ids = frozenset() if eos is None else frozenset(torch.as_tensor(eos).reshape(-1).tolist())
    if assistant_model is not None:
        if draft is not None:
            raise ValueError("pass the draft model once: assistant_model= or draft=, not both")
        draft = lm if assistant_model is model else LM(assistant_model, lm.tokenizer)
    draft = resolve_draft(lm, draft)
    if tokenizer is None and draft is not None and not isinstance(draft.tokenizer, TokenIds):
        lm.tokenizer = draft.tokenizer  # none came with the call: the draft's, which a draft must share anyway
    return lm, draft


def _emitted(
    events, input_ids: torch.Tensor, stopping_criteria, streamer=None, until_stopped: bool = False
) -> tuple[list[list[int]], list[Result | None]]:
    """Each row's new tokens from the run's `events`, cut where a stopping criterion fires on the row's own sequence
    (its left padding included, as transformers counts). `until_stopped`: stop reading once every row stopped."""
    prompts = [row.tolist() for row in input_ids]
    new: list[list[int]] = [[] for _ in prompts]
    stopped = [False] * len(prompts)
    results: list[Result | None] = [None] * len(prompts)
    for index, chunk, result in events:
        kept = []
        for token in [] if stopped[index] else chunk.tokens:  # a criterion that fires inside a step ends the row there
            new[index].append(token)
            kept.append(token)
            sequence = torch.tensor([prompts[index] + new[index]], device=input_ids.device)  # [1, T + n]
            if stopping_criteria is not None and bool(stopping_criteria(sequence, None).any()):
                stopped[index] = True
                break
        if streamer is not None and kept:
            streamer.put(torch.tensor([kept]))  # [1, n]
        if result is not None:
            results[index] = result
        if until_stopped and all(stopped):
            break
    if streamer is not None:
        streamer.end()
    return new, results


def _padded(input_ids: torch.Tensor, new: list[list[int]], pad: int) -> torch.Tensor:
    """The prompts and new tokens as transformers returns a batch: [B, T + longest], `pad` after rows that ended."""
    width = input_ids.shape[1]
    sequences = torch.full((len(new), width + max(map(len, new))), pad, dtype=torch.long, device=input_ids.device)
    sequences[:, :width] = input_ids
    for index, tokens in enumerate(new):
        sequences[index, width : width + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return sequences
