"""`LM`: one Hugging Face causal LM and its tokenizer, with the single forward call every strategy uses."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import warnings
from collections.abc import Sequence

import torch

from decoders.models.attention import use_grouped
from decoders.models.cache import KVCache
from decoders.models.device import synchronize
from decoders.models.graphs import StaticKVCache
from decoders.models.held import Held
from decoders.models.linear import use_native
from decoders.models.native import NativeStep
from decoders.models.native_check import attach
from decoders.models.probes import probe_static_cache, probe_tree_mask

_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


class LM:
    """A transformers causal LM plus its tokenizer, batch 1, in evaluation mode."""

    def __init__(self, model, tokenizer, name: str | None = None) -> None:
        if tokenizer is None:
            raise ValueError("an LM needs its tokenizer: decoders.wrap(model, tokenizer)")
        self.model = model.eval()
        use_grouped(model)  # the same scores, without copying keys per query head (`models.attention`)
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.config = model.config.get_text_config(decoder=True)
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        head = model.get_output_embeddings()  # (its width without reading an int8 head's weights back)
        self.vocab_size = getattr(head, "out_features", None) or head.weight.shape[0]  # may exceed len(tokenizer)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.held = Held()
        self.quantized_from = None  # a weakref to the float LM this is a quantized copy of
        self.context_length = next(
            (v for f in _CONTEXT_FIELDS if isinstance(v := getattr(self.config, f, None), int) and v > 0), None
        )
        # calls as CUDA graphs on a static cache (`models.graphs`); False: transformers' own calls
        self.cuda_graphs = self.device.type == "cuda"
        # torch.compile the graph-captured calls: tens of seconds for fewer kernels; a string is torch.compile's mode
        self.compile_calls: bool | str = False
        # the native step, or None: transformers' calls, their bfloat16 few-row products on its kernel (`models.linear`)
        self.native = attach(self)
        if self.native is None:
            use_native(model)

    def __repr__(self) -> str:
        return f"LM({self.name!r}, {type(self.model).__name__}, dtype={self.dtype}, device={self.device})"

    @property
    def native(self) -> NativeStep | None:
        """Its native step (`models.native`), or None: transformers' calls (settable: None turns it off)."""
        return self.held.native

    @native.setter
    def native(self, step: NativeStep | None) -> None:
        self.held.native = step

    @property
    def compile_calls(self) -> bool | str:
        return self._compile_calls

    @compile_calls.setter
    def compile_calls(self, value: bool | str) -> None:
        """True, False, or a torch.compile mode: anything else is refused now, not at the first captured call."""
        if not isinstance(value, bool):
            from torch._inductor import list_mode_options  # (seconds to import: only where a mode is named)

            modes = ["default", *(m for m in list_mode_options() if m != "default")]
            if value not in modes:
                raise ValueError(
                    f"compile_calls takes True, False or a torch.compile mode ({', '.join(modes)}), got {value!r}"
                )
        self._compile_calls = value

    def synchronize(self) -> None:
        """Wait for this model's device, before reading a clock."""
        synchronize(self.device)

    def static_cache_ok(self) -> bool:
        """Whether this LM's calls run on a static cache: the native step's, or CUDA graphs' where `cuda_graphs` is on
        and a probe scores on one as on transformers' cache."""
        if self.native is not None:
            return True
        if self.cuda_graphs and self.held.static_cache is None:
            self.held.static_cache = probe_static_cache(self)
            if self.held.static_cache is not True:
                warnings.warn(
                    f"{self.name}: {type(self.model).__name__} {self.held.static_cache} on a static cache; its "
                    "calls run eagerly on transformers' cache (no CUDA graphs)",
                    stacklevel=3,
                )
        return self.cuda_graphs and self.held.static_cache is True

    def new_cache(self, length: int = 0) -> KVCache | StaticKVCache:
        """An empty KV cache, static where `static_cache_ok`; `length`: the positions a static cache reserves."""
        return StaticKVCache(self, length) if self.static_cache_ok() else KVCache()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the tokenizer's usual special tokens."""
        return self.tokenizer(text)["input_ids"]

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of `tokens`, special tokens left out."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,  # [T] new token ids, after the len(cache) cached ones
        cache: KVCache | StaticKVCache,
        positions: Sequence[int] | torch.Tensor | None = None,  # [T] position ids; default len(cache) + 0..T-1
        tree_mask: torch.Tensor | None = None,  # [T, T] (or [T, len(cache) + T]) bool: i sees j; default causal
        keep: int = 0,  # logits of the last `keep` positions only (0 = all): skips the prompt's lm_head
    ) -> torch.Tensor:
        """Score `tokens` against `cache` (which grows by T): logits [T or keep, vocab] in float32 (exact from any
        dtype; faster to argmax on a CPU)."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(1, -1)  # [1, T]
        past, length = len(cache), ids.shape[1]
        if positions is None:
            pos = torch.arange(past, past + length, device=self.device).unsqueeze(0)  # [1, T]
        else:
            pos = torch.as_tensor(positions, dtype=torch.long, device=self.device).reshape(1, -1)
        if isinstance(cache, StaticKVCache):
            if cache.lm is not self and (self.quantized_from is None or self.quantized_from() is not cache.lm):
                raise ValueError(f"{self.name}: this static cache belongs to {cache.lm.name}")
            return cache.forward(self, ids, pos, tree_mask, keep).float()
        mask = None if tree_mask is None else self._tree_attention_mask(tree_mask, pos[0], past)
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=keep,
            **{self.cache_keyword: cache.hf},
        )
        return out.logits[0].float()  # [T or keep, vocab]

    @functools.cached_property
    def cache_keyword(self) -> str:
        """The keyword the model's forward takes its KV cache by: `cache` (transformers 5.24+) or `past_key_values`."""
        return "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    @functools.cached_property
    def vocab_key(self) -> str:
        """A fingerprint of the tokenizer's token -> id map."""
        items = sorted(self.tokenizer.get_vocab().items(), key=lambda item: item[1])
        return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()

    def check_draft(self, draft: LM) -> None:
        """Raise unless `draft` shares this model's token -> id map (the logits' padding aside)."""
        if draft.vocab_key == self.vocab_key:
            return
        ours, theirs = self.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
        differing = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
        raise ValueError(
            f"draft model {draft.name!r} does not share the tokenizer of {self.name!r} ({len(theirs)} vs "
            f"{len(ours)} tokens; first differences: {differing}); a draft must use the same vocabulary"
        )

    def _tree_attention_mask(self, tree_mask: torch.Tensor, positions: torch.Tensor, past: int):
        """`attention_masks` [1, 1, T, past + T]: the cached prefix visible to every node, the rest per `tree_mask`
        ([T, T] or [T, past + T]); a cached key's position is its index."""
        length = tree_mask.shape[0]
        allowed = torch.ones(length, past + length, dtype=torch.bool, device=self.device)
        allowed[:, past + length - tree_mask.shape[1] :] = tree_mask.to(self.device, torch.bool)
        key_positions = torch.cat([torch.arange(past, device=self.device), positions])  # [past + T]
        return self.attention_masks(allowed[None], key_positions[None], positions[None])

    def attention_masks(self, allowed: torch.Tensor, keys: torch.Tensor, queries: torch.Tensor):
        """Additive 4D masks [B, 1, Q, K] from `allowed` [B, Q, K]; sliding-window layers' also hide keys (positions
        `keys` [B, K]) a window or more behind their query (`queries` [B, Q]). One per layer type if mixed."""
        allowed = allowed.to(self.device)
        masks = {"full_attention": allowed}
        window = getattr(self.config, "sliding_window", None)
        if window:
            near = keys.to(self.device)[:, None, :] > queries.to(self.device)[:, :, None] - window
            masks["sliding_attention"] = allowed & near
        blocked = torch.finfo(self.dtype).min
        additive = {
            kind: torch.zeros(m.shape, dtype=self.dtype, device=self.device).masked_fill(~m, blocked)[:, None]
            for kind, m in masks.items()
        }
        layer_types = set(getattr(self.config, "layer_types", None) or [])
        if len(layer_types) > 1:
            return {kind: additive[kind] for kind in layer_types}
        if window and layer_types <= {"sliding_attention"}:
            return additive["sliding_attention"]
        return additive["full_attention"]

    def check_tree_mask(self, role: str = "target") -> None:
        """Raise naming the model's `role` unless a tree-masked call scores each node as its path would (probed)."""
        if self.held.tree_mask is None:
            self.held.tree_mask = probe_tree_mask(self)
        if self.held.tree_mask is not True:
            raise TypeError(
                f"{role} model {self.name!r}: {type(self.model).__name__} cannot score a token tree in one call "
                f"(it {self.held.tree_mask}); use a chain strategy (speculative, threshold, prompt_lookup) with this "
                "model"
            )


def _eos_ids(model, tokenizer) -> frozenset[int]:
    """Every id that ends generation: the generation config's, else the model config's, else the tokenizer's EOS."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset()


def wrap(model, tokenizer, name: str | None = None) -> LM:
    """Wrap an already-loaded transformers causal LM and its tokenizer."""
    return LM(model, tokenizer, name=name)
