"""`load`: a model and its tokenizer, by name."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch

from decoders.models.device import resolve_device
from decoders.models.lm import LM

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def load(
    name_or_path: str | os.PathLike, dtype: str | torch.dtype | None = "auto", device=None, quantize: str | None = None
) -> LM:
    """Load a model + tokenizer: `zoo:NAME`, a local folder, a local .gguf file, or a Hugging Face hub id.
    `quantize="int8"` returns its int8 copy (`decoders.quantize`), e.g. a cheap draft."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decoders.models import zoo

    name = str(name_or_path)
    torch_dtype = "auto" if dtype is None or dtype == "auto" else _DTYPES.get(dtype, dtype)  # "auto": the checkpoint's
    if not (torch_dtype == "auto" or isinstance(torch_dtype, torch.dtype)):
        raise ValueError(f"unknown dtype {dtype!r}; use one of: auto, {', '.join(sorted(_DTYPES))}")
    torch_device = resolve_device(device)
    kwargs: dict = {}
    if name.startswith("zoo:"):
        source = str(zoo.path(name[len("zoo:") :]))
    elif name.endswith(".gguf") and Path(name).is_file():
        source, kwargs["gguf_file"] = str(Path(name).parent), Path(name).name
    else:
        source = name
    if Path(source).is_dir():
        if "gguf_file" not in kwargs and not (Path(source) / "config.json").is_file():
            raise OSError(f"could not load model {name!r}: the folder {source} has no config.json")
    elif source.startswith((".", "/", "~")) or source.count("/") > 1 or source.endswith(".gguf"):
        raise OSError(f"could not load model {name!r}: no such local folder or .gguf file")
    elif not _hub_may_have(source):
        raise OSError(
            f"no local folder, zoo name or cached hub model called {name!r} (and the Hugging Face hub is "
            f"not reachable from here); zoo models: {', '.join('zoo:' + n for n in zoo.names())}"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    except OSError as error:
        raise OSError(
            f"could not load model {name!r}: {error}\nUse a zoo model (`decodekit list` shows them, e.g. "
            "zoo:smollm2-135m), a local folder, or a hub id on a machine that can reach the Hugging Face hub."
        ) from error
    lm = LM(model.to(torch_device), tokenizer, name=name)
    if quantize is None:
        return lm
    from decoders.models import quantize as quantizing

    return quantizing.quantize(lm, quantize)


def _hub_may_have(name: str) -> bool:
    """Whether hub id `name` is in the local hub cache or the hub is reachable (at once False under HF_HUB_OFFLINE)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return True
    if constants.HF_HUB_OFFLINE:
        return False
    try:
        socket.create_connection((urlparse(constants.ENDPOINT).hostname, 443), timeout=3).close()
    except OSError:
        return False
    return True
