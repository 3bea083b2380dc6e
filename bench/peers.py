"""Peers for our benchmarks: llama.cpp (via the ``xllamacpp`` wheel) and HF ``transformers``.

Both are measured the same way: greedy, a fixed number of new tokens (EOS ignored), the same
thread count.  Definitions shared by every ``*_speed`` result:

- ``prefill_tokens_per_s`` = prompt tokens / time to process the prompt (and pick token 1);
- ``decode_tokens_per_s``  = (new tokens - 1) / time from token 1 to the last token, i.e. one
  token per decode forward.  This is exactly llama.cpp's own ``predicted_per_second``
  (its ``predicted_per_token_ms`` is ``predicted_ms / (predicted_n - 1)``).

llama.cpp runs in a child process (``python -c`` + ``xllamacpp.Server``), so its threads, memory
and logs stay apart from the torch process doing the measuring, and exit is certain.

Run ``python bench/peers.py`` for a smoke table on smollm2-135m.
"""

from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

_SERVER_CHILD = r"""
import json, sys
import xllamacpp as x
cfg = json.loads(sys.argv[1])
p = x.CommonParams()
p.model.path = cfg["model"]
p.n_ctx = cfg["n_ctx"]
p.n_parallel = cfg["n_parallel"]
p.cpuparams.n_threads = cfg["threads"]
p.cpuparams_batch.n_threads = cfg["threads"]
if cfg["poll"] is not None:
    p.cpuparams.poll = p.cpuparams_batch.poll = cfg["poll"]
p.hostnames = ["127.0.0.1"]
p.port = cfg["port"]
p.cache_prompt = False
p.endpoint_metrics = True
p.verbosity = cfg["verbosity"]
s = x.Server(p)
print(s.listening_address, flush=True)
sys.stdin.read()  # serve until the parent closes our stdin (or dies)
del s
"""


class LlamaCppServer:
    """llama.cpp's OpenAI-compatible HTTP server in a child process; a context manager.

    ``ctx_size`` is the context of one slot; the server gets ``ctx_size * n_parallel`` in all
    (llama.cpp splits ``n_ctx`` evenly across its ``n_parallel`` slots).  ``port=None`` lets
    the server bind a free ephemeral port itself (no race).  ``.base_url`` ends in ``/v1``;
    ``.root_url`` serves the native endpoints (``/completion``, ``/health``, ``/metrics``).
    ``poll`` is ggml's busy-wait level 0-100 (None: llama.cpp's default, 50); 0 sleeps instead
    of spinning, which matters when another process shares the cores.  The log (stderr) is
    deleted on exit unless ``keep_log``.
    """

    def __init__(
        self,
        gguf_path: str | os.PathLike[str],
        threads: int = 2,
        n_parallel: int = 1,
        ctx_size: int = 4096,
        port: int | None = None,
        startup_timeout_s: float = 180.0,
        verbosity: int = 3,
        keep_log: bool = False,
        poll: int | None = None,
    ) -> None:
        self.gguf_path = str(gguf_path)
        self.threads, self.n_parallel, self.ctx_size = threads, n_parallel, ctx_size
        self.port = port or 0
        self.startup_timeout_s = startup_timeout_s
        self.verbosity = verbosity
        self.keep_log = keep_log
        self.poll = poll
        self.root_url = ""
        self.base_url = ""
        self.startup_s = 0.0
        self._proc: subprocess.Popen[str] | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="llamacpp-", suffix=".log", delete=False)

    @property
    def log_path(self) -> str:
        """Path of the server's log (llama.cpp writes to stderr)."""
        return self._log.name

    def _log_tail(self, n: int = 2000) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-n:]

    def __enter__(self) -> LlamaCppServer:
        cfg = {
            "model": self.gguf_path,
            "n_ctx": self.ctx_size * self.n_parallel,
            "n_parallel": self.n_parallel,
            "threads": self.threads,
            "port": self.port,
            "verbosity": self.verbosity,
            "poll": self.poll,
        }
        t0 = time.perf_counter()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER_CHILD, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        try:
            self.root_url = self._read_address(t0 + self.startup_timeout_s)
            self.base_url = self.root_url + "/v1"
            self._wait_healthy(t0 + self.startup_timeout_s)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _read_address(self, deadline: float) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        while time.perf_counter() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited ({self._proc.returncode}):\n{self._log_tail()}")
            ready, _, _ = select.select([self._proc.stdout], [], [], 0.2)
            if ready:
                line = self._proc.stdout.readline().strip()
                if line.startswith("http"):
                    return line.rstrip("/")
        raise TimeoutError(
            f"llama.cpp server did not start in {self.startup_timeout_s} s:\n{self._log_tail()}"
        )

    def _wait_healthy(self, deadline: float) -> None:
        while time.perf_counter() < deadline:
            try:
                if httpx.get(self.root_url + "/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"llama.cpp server not healthy at {self.root_url}:\n{self._log_tail()}")

    def close(self) -> None:
        """Stop the server: close its stdin (clean exit), then SIGTERM, then SIGKILL."""
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(timeout=15)
            except (subprocess.TimeoutExpired, OSError):
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self._log.close()
        if not self.keep_log:
            Path(self._log.name).unlink(missing_ok=True)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def complete(self, client: httpx.Client, prompt_token_ids: list[int], max_new_tokens: int) -> dict:
        """Greedy /completion on token ids: exactly ``max_new_tokens`` tokens, no prompt cache."""
        body = {
            "prompt": prompt_token_ids,
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_prompt": False,
            "stream": False,
        }
        r = client.post(self.root_url + "/completion", json=body, timeout=None)
        r.raise_for_status()
        return r.json()


def llamacpp_speed(
    gguf_path: str | os.PathLike[str], prompt_token_ids: list[int], max_new_tokens: int, threads: int
) -> dict[str, Any]:
    """Single-stream greedy prefill and decode speed, from llama.cpp's own ``timings``."""
    ctx = len(prompt_token_ids) + max_new_tokens + 16
    with LlamaCppServer(gguf_path, threads=threads, n_parallel=1, ctx_size=ctx) as srv, httpx.Client() as c:
        srv.complete(c, prompt_token_ids[:8], 4)  # warm the request path
        res = srv.complete(c, prompt_token_ids, max_new_tokens)
    t = res["timings"]
    n = int(t["predicted_n"])
    return {
        "engine": "llama.cpp",
        "prompt_tokens": int(t["prompt_n"]),
        "new_tokens": n,
        "prefill_s": t["prompt_ms"] / 1e3,
        "decode_s": t["predicted_ms"] / 1e3,
        "prefill_tokens_per_s": float(t["prompt_per_second"]),
        "decode_tokens_per_s": float(t["predicted_per_second"]) if n > 1 else float("nan"),
        "server_startup_s": srv.startup_s,
        "threads": threads,
    }


def llamacpp_throughput(
    gguf_path: str | os.PathLike[str],
    prompts: list[list[int]],
    max_new_tokens: int,
    concurrency: int,
    threads: int,
) -> dict[str, Any]:
    """Aggregate greedy tokens/s with ``concurrency`` requests in flight (``n_parallel`` slots)."""
    ctx = max(len(p) for p in prompts) + max_new_tokens + 16
    with (
        LlamaCppServer(gguf_path, threads=threads, n_parallel=concurrency, ctx_size=ctx) as srv,
        httpx.Client(limits=httpx.Limits(max_connections=concurrency + 4)) as c,
        ThreadPoolExecutor(max_workers=concurrency) as pool,
    ):
        srv.complete(c, prompts[0][:8], 4)
        t0 = time.perf_counter()
        results = list(pool.map(lambda p: srv.complete(c, p, max_new_tokens), prompts))
        wall = time.perf_counter() - t0
    generated = sum(int(r["tokens_predicted"]) for r in results)
    return {
        "engine": "llama.cpp",
        "requests": len(prompts),
        "concurrency": concurrency,
        "generated_tokens": generated,
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "threads": threads,
    }


_HF_MODELS: dict[str, Any] = {}


def hf_model(gguf_path: str | os.PathLike[str]) -> Any:
    """transformers model (fp32, eval) loaded from the GGUF, offline; cached per path."""
    key = str(Path(gguf_path).resolve())
    if key not in _HF_MODELS:
        os.environ["HF_HUB_OFFLINE"] = "1"
        import torch
        from transformers import AutoModelForCausalLM

        p = Path(key)
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
        _HF_MODELS[key] = model.eval()
    return _HF_MODELS[key]


def _greedy_kwargs(model: Any, max_new_tokens: int, cache_implementation: str | None) -> dict[str, Any]:
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else gc.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    kw: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": max_new_tokens,
        "do_sample": False,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "pad_token_id": 0 if pad is None else pad,
    }
    if cache_implementation is not None:
        kw["cache_implementation"] = cache_implementation
    return kw


def _warmup(model: Any, prompt: list[int], kw: dict[str, Any]) -> None:
    import torch

    ids = torch.tensor([prompt[:8]], dtype=torch.long)
    model.generate(
        ids, attention_mask=torch.ones_like(ids), **{**kw, "max_new_tokens": 2, "min_new_tokens": 2}
    )


def hf_speed(
    gguf_path: str | os.PathLike[str],
    prompt_token_ids: list[int],
    max_new_tokens: int,
    threads: int,
    cache_implementation: str | None = None,
) -> dict[str, Any]:
    """Single-stream greedy speed of transformers: prefill = one timed forward over the prompt,
    decode = (greedy ``generate`` time - prefill) over ``max_new_tokens - 1`` steps."""
    import torch

    torch.set_num_threads(threads)
    model = hf_model(gguf_path)
    ids = torch.tensor([prompt_token_ids], dtype=torch.long)
    mask = torch.ones_like(ids)
    kw = _greedy_kwargs(model, max_new_tokens, cache_implementation)
    with torch.inference_mode():
        _warmup(model, prompt_token_ids, kw)
        t0 = time.perf_counter()
        model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        total = time.perf_counter() - t0
    n = int(out.shape[1] - ids.shape[1])
    decode = max(total - prefill, 1e-9)
    return {
        "engine": "transformers",
        "prompt_tokens": len(prompt_token_ids),
        "new_tokens": n,
        "prefill_s": prefill,
        "decode_s": decode,
        "prefill_tokens_per_s": len(prompt_token_ids) / prefill,
        "decode_tokens_per_s": (n - 1) / decode if n > 1 else float("nan"),
        "threads": threads,
    }


def hf_throughput(
    gguf_path: str | os.PathLike[str],
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int,
    threads: int,
    cache_implementation: str | None = None,
) -> dict[str, Any]:
    """Aggregate greedy tokens/s of transformers ``generate`` in left-padded batches."""
    import torch

    torch.set_num_threads(threads)
    model = hf_model(gguf_path)
    kw = _greedy_kwargs(model, max_new_tokens, cache_implementation)
    pad = kw["pad_token_id"]
    with torch.inference_mode():
        _warmup(model, prompts[0], kw)
        generated = 0
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, p in enumerate(batch):
                ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[row, width - len(p) :] = 1
            out = model.generate(ids, attention_mask=mask, **kw)
            generated += int(out.shape[1] - width) * len(batch)
        wall = time.perf_counter() - t0
    return {
        "engine": "transformers",
        "requests": len(prompts),
        "batch_size": batch_size,
        "generated_tokens": generated,
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "threads": threads,
    }


def synthetic_prompt(n_tokens: int, seed: int = 0, low: int = 1000, high: int = 30000) -> list[int]:
    """Deterministic token ids in [low, high): valid, non-special ids in all our vocabularies."""
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(n_tokens)]


def _main() -> None:
    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import xllamacpp

    from tokenhaul.models.catalog import resolve

    gguf = resolve("smollm2-135m").gguf_path
    prompt, new, threads = synthetic_prompt(64), 32, 2
    rows = [llamacpp_speed(gguf, prompt, new, threads), hf_speed(gguf, prompt, new, threads)]
    print(
        f"smollm2-135m  prompt={len(prompt)}  new={new}  threads={threads}  xllamacpp={xllamacpp.__version__}"
    )
    print(f"{'engine':<14}{'prefill tok/s':>15}{'decode tok/s':>14}{'prefill s':>11}{'decode s':>10}")
    for r in rows:
        print(
            f"{r['engine']:<14}{r['prefill_tokens_per_s']:>15.1f}{r['decode_tokens_per_s']:>14.1f}"
            f"{r['prefill_s']:>11.3f}{r['decode_s']:>10.3f}"
        )
    print(f"(llama.cpp server startup {rows[0]['server_startup_s']:.1f} s)")


if __name__ == "__main__":
    _main()
