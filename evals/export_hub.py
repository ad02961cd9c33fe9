"""`decodekit export-hub DIR [--strategy S]`: a custom_generate folder that runs decodekit inside `model.generate`.

    export_hub("my-decoding", strategy="staged")
    model.generate(**inputs, custom_generate="my-decoding", trust_remote_code=True, assistant_model=draft)

The folder holds `custom_generate/generate.py` (a few lines calling `decoders.hf.hub_generate`) and
`custom_generate/requirements.txt` (decodekit), plus a README: the layout transformers loads from a local folder or,
once uploaded, from a Hugging Face Hub repository.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

GENERATE_PY = '''"""decodekit's lossless decoding strategies in `model.generate` (written by `decodekit export-hub`).

    model.generate(**inputs, custom_generate="path/or/hub-id", trust_remote_code=True,
                   strategy="{example}", ...)

Every argument goes to `decoders.hf.hub_generate`; see `decoders.hf` for what carries over.
"""

from decoders.hf import hub_generate

STRATEGY = {strategy!r}  # when the call names no strategy= (None: decodekit's default, greedy)


def generate(*args, model, **kwargs):  # `model` by keyword: transformers binds it so (positional args are inputs)
    if STRATEGY is not None:
        kwargs.setdefault("strategy", STRATEGY)
    return hub_generate(model, *args, **kwargs)
'''

README = """---
library_name: transformers
tags:
  - custom_generate
---

# decodekit: {title}

Lossless decoding strategies of [decodekit](https://pypi.org/project/decodekit/) inside `model.generate`: greedy
mode returns exactly greedy decoding's tokens, sampling mode samples from exactly the model's distribution.

```python
out = model.generate(**inputs, custom_generate="{where}", trust_remote_code=True,
                     {arguments}max_new_tokens=128)
```

Strategies (`strategy=`): {strategies}.
Draft-model strategies take the draft as `assistant_model=`; a strategy's options are keyword arguments (`k=4`);
`return_dict_in_generate=True` adds `decodekit_stats`. One prompt at a time.
"""


def export_hub(directory: str | Path, strategy: str | None = None) -> Path:
    """Write a custom_generate folder to `directory` (created if needed; its custom_generate files are replaced);
    `strategy` becomes the default when a call names none. Returns the folder's path."""
    import decoders

    if strategy is not None:
        decoders.registry.get(strategy)  # an unknown name raises here, with the known ones
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root} exists and is not a folder; give a folder path for the export")
    code = root / "custom_generate"
    code.mkdir(parents=True, exist_ok=True)
    example = strategy or "speculative"
    (code / "generate.py").write_text(GENERATE_PY.format(strategy=strategy, example=example), encoding="utf-8")
    (code / "requirements.txt").write_text(f"{_requirement()}\n", encoding="utf-8")
    readme = root / "README.md"
    if not readme.exists():  # a model card the user wrote stays
        arguments = "" if strategy else f'strategy="{example}", '
        if decoders.registry.get(example).needs_draft:
            arguments += "assistant_model=draft, "
        readme.write_text(
            README.format(
                title=f"{strategy} decoding" if strategy else "decoding strategies",
                where=root.name,
                arguments=arguments,
                strategies=", ".join(decoders.available()),
            ),
            encoding="utf-8",
        )
    return root


def _requirement() -> str:
    """decodekit at least as new as the running one (the version that has decoders.hf)."""
    try:
        return f"decodekit>={version('decodekit')}"
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "decodekit"
