"""Server test kit: uvicorn in a background thread on a free port, and a scripted model (real
EngineCore, scheduler and KV pool; logits from a script, so a step takes microseconds)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable

import httpx
import torch
import uvicorn

from tokenhaul.config import EngineConfig
from tokenhaul.decoding.grammar import GrammarCompiler
from tokenhaul.engine.core import EngineCore
from tokenhaul.models.config import ModelConfig
from tokenhaul.server.async_engine import AsyncEngine
from tokenhaul.server.guards import ServerOptions
from tokenhaul.server.http_protocol import uvicorn_config
from tokenhaul.text.tokenizer import Tokenizer

MODEL = "smollm2-135m"
SCRIPT_TEXT = "Hello, world! 你好，世界。🙂🚀 def add(a, b):\n    return a + b  # done.\n"


class ScriptModel:
    """Next token after position p is script[(p + 1) % len(script)]: logits are one-hot with a margin
    no sampler setting can overturn. `delay` seconds per forward simulate a slow model. Records the
    threads it ran on (the core thread only, if the front end is right)."""

    def __init__(self, vocab_size: int, script: list[int], max_position: int = 4096) -> None:
        self.config = ModelConfig(arch="llama", hidden_size=1, num_layers=1, num_heads=1, num_kv_heads=1,
                                  head_dim=1, ffn_size=1, vocab_size=vocab_size, max_position=max_position,
                                  norm_eps=1e-5, rope_theta=1e4, tie_embeddings=True)
        self.script = torch.tensor(script)
        self.delay = 0.0
        self.threads: set[str] = set()

    def forward(self, input_ids: torch.Tensor, meta, kv) -> torch.Tensor:
        self.threads.add(threading.current_thread().name)
        if self.delay:
            time.sleep(self.delay)
        return meta.positions.to(torch.float32)[:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        pos = hidden[:, 0].long()
        nxt = self.script[(pos + 1) % len(self.script)]
        logits = torch.zeros(len(pos), self.config.vocab_size)
        logits[torch.arange(len(pos)), nxt] = 60.0
        return logits


class ServerThread:
    """uvicorn serving `app` from a daemon thread on 127.0.0.1:<free port> with the timeouts of
    `options` (those of `tokenhaul serve`); a context manager."""

    def __init__(self, app, options: ServerOptions | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn_config(app, options or ServerOptions(), log_level="warning",
                                                    access_log=False, timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log: Callable[[], str]) -> None:
    """Until `url`/health answers 200; fails with `log()` if the server process exits first."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"server did not come up within {timeout:g} s"
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_idle(engine: AsyncEngine, timeout: float = 30.0) -> None:
    """Until the front end has no requests and the core's snapshot shows an empty batch."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.client.core_thread.stats
        if engine.num_unfinished == 0 and s.num_running == 0 and s.num_waiting == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle after {timeout} s: {engine.client.core_thread.stats}")


def script_engine(tokenizer: Tokenizer, max_waiting: int = 256, **config) -> tuple[AsyncEngine, ScriptModel]:
    ids = tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
    model = ScriptModel(tokenizer.vocab_size, ids)
    cfg = dict(model="script", num_kv_blocks=64, block_size=16, max_model_len=256, max_num_seqs=16,
               max_num_batched_tokens=512) | config
    grammars = GrammarCompiler(lambda: (tokenizer.backend.to_str(), tokenizer.eos_token_ids), tokenizer.vocab_size)
    core = EngineCore(EngineConfig(**cfg), model, grammars=grammars)
    return AsyncEngine(core, tokenizer, "script-model", max_waiting), model
