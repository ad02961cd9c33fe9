"""llama.cpp peers: `llamacpp:greedy`, `llamacpp:draft` and `llamacpp:ngram`, driven through `llama-server` as its
users run it, on the same weights (a GGUF of the same dtype, `evals.llamacpp_build.convert`).

`compare` starts one server per llama.cpp method (peer and settings) at its first request and stops them all when the
run ends or fails. Every request is greedy (`top_k` 1, the only sampler), stops only at llama.cpp's end-of-generation
tokens or at max_new_tokens, caches no prompt, and sends the prompt as decodekit's own chat-templated token ids:

    llamacpp:greedy   plain decoding
    llamacpp:draft    --spec-type draft-simple with the --draft model's GGUF; settings n_max, n_min, p_min
                      (llama.cpp's own defaults: 3, 0, 0.0)
    llamacpp:ngram    --spec-type ngram-mod, llama.cpp's best draft-free mode (its --spec-default); settings n_match,
                      n_min, n_max (24, 48, 64). Its n-gram pool outlives a request, so its server is started afresh
                      for every request: the pool holds that prompt and its own output, as decodekit's `suffix` sees.

A request is timed by the wall clock around it, as the other peers are timed around `generate`: tok/s = new tokens /
those seconds. llama.cpp's own `timings` (prompt_ms, predicted_ms, predicted_n, draft_n, draft_n_accepted) are kept in
the run's `extra`; TTFT is the request's seconds less predicted_ms (what llama.cpp spent after its first token).
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import pathlib
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

import torch

from evals import llamacpp_build as builds
from evals.timing import Run, pieces

HOST = "127.0.0.1"
START_SECONDS = 300  # how long a server may take to load its model(s) before it counts as failed to start
REQUEST = {
    "temperature": 0.0,
    "top_k": 1,
    "samplers": ["top_k"],
    "ignore_eos": False,
    "cache_prompt": False,
    "return_tokens": True,
    "stream": False,
}  # greedy, EOS honoured, nothing reused from an earlier request


class LlamaCppError(RuntimeError):
    """A llama-server that failed to start, died, or answered with an error."""


def arguments(base: str, settings: dict, draft: pathlib.Path | None) -> list[str]:
    """The llama-server arguments of peer `base` with `settings` (its speculation); `draft` the draft's GGUF."""
    if base == "llamacpp:draft":
        return [
            "-md",
            str(draft),
            "--spec-type",
            "draft-simple",
            "--spec-draft-n-max",
            str(settings["n_max"]),
            "--spec-draft-n-min",
            str(settings["n_min"]),
            "--spec-draft-p-min",
            str(settings["p_min"]),
        ]
    if base == "llamacpp:ngram":
        return [
            "--spec-type",
            "ngram-mod",
            "--spec-ngram-mod-n-match",
            str(settings["n_match"]),
            "--spec-ngram-mod-n-min",
            str(settings["n_min"]),
            "--spec-ngram-mod-n-max",
            str(settings["n_max"]),
        ]
    return []


def check_settings(name: str, settings: dict) -> None:
    """Refuse a setting that is not a whole number >= 0 (p_min: a probability), before any model loads."""
    for key, value in settings.items():
        ok = (
            isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1
            if key == "p_min"
            else isinstance(value, int) and not isinstance(value, bool) and value >= 0
        )
        if not ok:
            want = "a probability between 0 and 1" if key == "p_min" else "a whole number >= 0"
            raise ValueError(f"method {name!r}: {key} must be {want}, got {value!r}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


try:  # resolved here, not in the forked child, where loading a library could wait on a lock another thread held
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


def _die_with_parent() -> None:
    """In the server's process before exec (Linux): be sent SIGTERM when decodekit dies, even by SIGKILL."""
    _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Server:
    """One llama-server process: `start` (waits for /health), `complete` (one /completion request), `stop`."""

    def __init__(self, build: builds.Build, args: list[str], label: str) -> None:
        self.build, self.args, self.label = build, args, label
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.log = tempfile.NamedTemporaryFile(prefix="decodekit-llama-server-", suffix=".log", delete=False)

    def tail(self, lines: int = 4) -> str:
        """The last lines of the server's log, for an error message."""
        text = [line.strip() for line in pathlib.Path(self.log.name).read_text(errors="replace").splitlines()]
        return " | ".join([line for line in text if line][-lines:]) or "(no output)"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = START_SECONDS) -> None:
        self.port = _free_port()
        command = [str(self.build.server), *self.args, "--host", HOST, "--port", str(self.port)]
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if _PRCTL else None,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LlamaCppError(
                    f"{self.label}: llama-server exited with status {self.process.returncode} while "
                    f"starting: {self.tail()}"
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                connection = http.client.HTTPConnection(HOST, self.port, timeout=5)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    return
            time.sleep(0.1)
        self.stop()
        raise LlamaCppError(f"{self.label}: llama-server did not answer /health within {timeout:.0f} s: {self.tail()}")

    def complete(self, body: dict, timeout: float = 3600) -> tuple[dict, float]:
        """POST /completion; returns its JSON answer and the request's wall-clock seconds."""
        payload = json.dumps(body).encode()
        connection = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            start = time.perf_counter()
            connection.request("POST", "/completion", payload, {"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
            seconds = time.perf_counter() - start
        except (OSError, http.client.HTTPException) as error:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(2)  # (a dying server closes the connection a moment before it is gone)
            if not self.alive:
                code = self.process.returncode if self.process else None
                raise LlamaCppError(
                    f"{self.label}: llama-server died during the request (exit status {code}): {self.tail()}"
                ) from None
            raise LlamaCppError(f"{self.label}: the request failed: {error}") from None
        finally:
            connection.close()
        if response.status != 200:
            said = data[:300].decode(errors="replace")
            raise LlamaCppError(f"{self.label}: llama-server answered {response.status}: {said}")
        return json.loads(data), seconds

    def peak_reset(self) -> None:
        """Reset the server process's peak resident memory (Linux), as decodekit resets its own before a run."""
        with contextlib.suppress(OSError):
            pathlib.Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")

    def peak_bytes(self) -> int | None:
        with contextlib.suppress(OSError):
            for line in pathlib.Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return None

    def stop(self) -> None:
        if self.alive:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def close(self) -> None:
        self.stop()
        self.log.close()
        pathlib.Path(self.log.name).unlink(missing_ok=True)


@dataclass
class _Peer:
    """A llama.cpp method of this compare: its server, and whether the server starts afresh for every request."""

    server: Server
    fresh: bool
    gguf: pathlib.Path
    bytes_per_token: int | None
    failed: str | None = None  # why the server could not start: every later request is refused with it at once


class Servers:
    """The llama-servers of one compare: `prepare` converts the weights before any run (a peer whose model llama.cpp's
    converter does not support is refused by name); `run` times one request; leaving the `with` stops them all."""

    def __init__(
        self, build: builds.Build, lm, draft=None, *, threads: int | None = None, context: int = 4096, say=None
    ) -> None:
        self.build, self.lm, self.draft, self.say = build, lm, draft, say
        self.threads = threads or torch.get_num_threads()
        self.context = context
        self.peers: dict[str, _Peer] = {}

    def prepare(self, methods: list, notes: list[str]) -> list:
        """The methods that can run: every llama.cpp one gets its GGUF(s) and server command (not started yet); one
        whose model cannot be converted is left out with a note naming it and why."""
        usable = []
        for method in methods:
            if not (method.is_peer and method.peer.engine == "llamacpp"):
                usable.append(method)
                continue
            try:
                gguf = self._gguf(self.lm)
                draft = self._gguf(self.draft, "draft") if method.peer.needs_draft else None
            except builds.ConversionError as error:
                notes.append(f"{method.name}: refused ({error})")
                continue
            args = [
                "-m",
                str(gguf),
                "-t",
                str(self.threads),
                "-tb",
                str(self.threads),
                "-c",
                str(self.context),
                "-np",
                "1",
                "--no-webui",
                "--no-cache-prompt",
                "--cache-ram",
                "0",
                *arguments(method.base, method.options, draft),
            ]
            self.peers[method.name] = _Peer(
                Server(self.build, args, method.name),
                method.base == "llamacpp:ngram",
                gguf,
                builds.bytes_per_token(gguf),
            )
            usable.append(method)
        return usable

    def _gguf(self, lm, role: str = "model") -> pathlib.Path:
        if lm is None or isinstance(lm, str):
            raise builds.ConversionError(f"llama.cpp drafts with a model file; the {role} {lm!r} is not one")
        return builds.convert(self.build, builds.model_folder(lm.name), lm.dtype, self.say)

    def _ready(self, peer: _Peer) -> Server:
        """The peer's server, (re)started when it is not running or must start afresh; a failed start is final."""
        if peer.failed:
            raise LlamaCppError(peer.failed)
        if peer.fresh:
            peer.server.stop()
        if not peer.server.alive:
            try:
                peer.server.start()
            except LlamaCppError as error:
                peer.failed = str(error)
                raise
        return peer.server

    def run(
        self,
        method,
        prompt: list[int],
        *,
        max_new_tokens: int,
        prompt_id: str = "",
        category: str = "",
        repeat: int = 0,
        **_,
    ) -> Run:
        """Time one request of llama.cpp method `method` on `prompt` (token ids); the record counts as every peer's."""
        peer = self.peers[method.name]
        server = self._ready(peer)
        server.peak_reset()
        answer, seconds = server.complete({**REQUEST, "prompt": list(prompt), "n_predict": max_new_tokens})
        return record(
            self.lm,
            method,
            prompt,
            answer,
            seconds,
            max_new_tokens,
            peer,
            server.peak_bytes(),
            prompt_id=prompt_id,
            category=category,
            repeat=repeat,
        )

    def close(self) -> None:
        for peer in self.peers.values():
            peer.server.close()

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def record(
    lm,
    method,
    prompt: list[int],
    answer: dict,
    seconds: float,
    max_new_tokens: int,
    peer: _Peer,
    peak: int | None,
    **where,
) -> Run:
    """The `Run` of one llama.cpp answer: tokens cut after decodekit's first EOS (inclusive) and at max_new_tokens,
    as every method's are counted; llama.cpp's own timings in `extra["llamacpp"]`."""
    tokens = list(answer.get("tokens") or [])[:max_new_tokens]
    end = next((i for i, t in enumerate(tokens) if t in lm.eos_token_ids), None)
    tokens = tokens if end is None else tokens[: end + 1]
    timings = answer.get("timings") or {}
    generated, predicted_ms = int(timings.get("predicted_n", len(tokens))), float(timings.get("predicted_ms", 0.0))
    speculative = method.base != "llamacpp:greedy"  # (drafted and accepted: absent where nothing was drafted)
    drafted, accepted = (
        (int(timings.get("draft_n") or 0), int(timings.get("draft_n_accepted") or 0)) if speculative else (None, None)
    )
    finish = "eos" if end is not None or answer.get("stop_type") == "eos" else "length"
    ttft = max(0.0, seconds - predicted_ms / 1e3) if tokens else seconds
    steps = generated - 1  # the first token comes from the prompt's call
    return Run(
        strategy=method.name,
        kind="peer",
        prompt_tokens=len(prompt),
        max_new_tokens=max_new_tokens,
        new_tokens=len(tokens),
        seconds=seconds,
        ttft_seconds=ttft,
        target_calls=generated - (accepted or 0) if generated else None,  # every call yields its accepted tokens + 1
        draft_calls=None,
        drafted=drafted,
        accepted=accepted,
        accepted_by_position=[],
        drafted_by_position=[],
        draft_seconds=None,
        peak_memory_bytes=peak,
        finish_reason=finish,
        tokens=tokens,
        sources=["target"] * len(tokens),
        pieces=pieces(lm, tokens),
        timeline=[(ttft, 1), (seconds, len(tokens))] if tokens else [],
        extra={
            "llamacpp": {
                **{
                    k: timings.get(k)
                    for k in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "draft_n", "draft_n_accepted")
                },
                "decode_ms_per_token": predicted_ms / steps if steps > 0 else None,
                "stop_type": answer.get("stop_type"),
                "gguf": peer.gguf.name,
                "bytes_per_token": peer.bytes_per_token,
            }
        },
        **where,
    )


def demonstrated(records: list[dict], name: str = "llamacpp:greedy") -> dict | None:
    """llama.cpp's demonstrated read bandwidth in this compare: the GGUF's bytes read per step / `name`'s decoding
    seconds per step (llama.cpp's own predicted_ms over its steps, every timed run); None where it did not run."""
    runs = [
        r["extra"]["llamacpp"]
        for r in records
        if r["strategy"] == name and r["repeat"] >= 0 and (r.get("extra") or {}).get("llamacpp")
    ]
    steps = sum(max(0, (x["predicted_n"] or 0) - 1) for x in runs)
    ms = sum(x["predicted_ms"] or 0.0 for x in runs)
    weights = next((x["bytes_per_token"] for x in runs if x.get("bytes_per_token")), None)
    if not steps or not ms or not weights:
        return None
    seconds = ms / 1e3 / steps
    return {
        "by": name,
        "bytes_per_token": weights,
        "seconds_per_token": seconds,
        "bandwidth_bytes_per_second": weights / seconds,
    }


def step_ms(
    model: str,
    dtype: str | torch.dtype = "bfloat16",
    *,
    tokens: int = 64,
    depth: int = 0,
    threads: int | None = None,
    repetitions: int = 5,
    llamacpp: str | None = None,
    prompt: int = 0,
) -> dict:
    """llama.cpp's batch-1 decoding step on `model` (a zoo name `zoo:NAME` or a folder) converted to `dtype`:
    `llama-bench -p 0 -n tokens -d depth -r repetitions` (one-token steps after `depth` tokens of context, timed by
    llama.cpp itself, after its own warm-up run: no HTTP, no sampling). Returns ms per step (mean, std, best of the
    repetitions), the GGUF's bytes read per step and the bandwidth that shows. `prompt` > 0: its prefill instead
    (`-p prompt -n 0`), ms per prompt token."""
    build = builds.require(llamacpp)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    gguf = builds.convert(build, builds.model_folder(model), dtype)
    threads = threads or torch.get_num_threads()
    generated = 0 if prompt else tokens
    command = [
        str(build.bench),
        "-m",
        str(gguf),
        "-p",
        str(prompt),
        "-n",
        str(generated),
        "-d",
        str(depth),
        "-t",
        str(threads),
        "-r",
        str(repetitions),
        "-o",
        "json",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise LlamaCppError(f"llama-bench failed (status {done.returncode}): {done.stderr.strip()[-600:]}")
    test = next(t for t in json.loads(done.stdout) if t.get("n_prompt" if prompt else "n_gen"))
    per = 1e6 * (test["n_prompt"] if prompt else test["n_gen"])  # ns per run -> ms per token
    weights = builds.bytes_per_token(gguf)
    best = min(test.get("samples_ns") or [test["avg_ns"]]) / per
    return {
        "ms_per_token": test["avg_ns"] / per,
        "std_ms": test["stddev_ns"] / per,
        "best_ms_per_token": best,
        "tokens": tokens,
        "depth": depth,
        "threads": threads,
        "repetitions": repetitions,
        "gguf": str(gguf),
        "bytes_per_token": weights,
        "bandwidth_bytes_per_second": weights / (best / 1e3) if weights else None,
        "command": " ".join(command),
        "version": builds.VERSION,
    }
