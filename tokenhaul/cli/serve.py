"""`serve`: the OpenAI-compatible HTTP server over one engine or a pool of Ray replicas."""

from __future__ import annotations

import argparse
import os

from tokenhaul.cli.args import add_engine_args, engine_kwargs


def add_parsers(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, /metrics)")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="name clients send as `model` (default: --model)")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="requests without a first token yet; beyond this, 429 (retry later)")
    s.add_argument("--api-key", default=os.environ.get("TOKENHAUL_API_KEY"),
                   help="clients must send 'Authorization: Bearer KEY' (default: $TOKENHAUL_API_KEY; /health "
                        "stays open)")
    s.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="Host header names answered ('*.example.org' ok; default: loopback names when bound to "
                        "loopback, else any)")
    s.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="CORS: browser origins allowed to call the API (default: none)")
    s.add_argument("--no-docs", action="store_true", help="do not serve /docs and /openapi.json")
    s.add_argument("--max-body-bytes", type=int, default=2 * 2**20, help="larger request bodies get 413")
    s.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longer prompts get 400 before tokenizing (default: 32 x the context length)")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request head")
    s.add_argument("--body-timeout", type=float, default=30.0, help="seconds a request has to send its body (408)")
    s.add_argument("--keep-alive-timeout", type=float, default=5.0, help="idle keep-alive connections close after")
    s.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may generate; then it ends with finish_reason 'abort' (default: no limit)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds to let requests in flight finish (new ones get 503), then exit 0")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve chat tool_choice 'auto' (the default with tools; else a 400), as vLLM")
    s.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                   help="how 'auto' reads tool calls from the text: hermes (<tool_call> JSON blocks, Qwen2.5)")
    s.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="chat tool_choice 'none' leaves the tools out of the prompt (default: rendered, as vLLM)")
    s.add_argument("--log-level", default="info")
    s.add_argument("--access-log", action="store_true")
    s.add_argument("--replicas", type=int, default=0,
                   help="N engine replicas as Ray actors (each --threads threads, its own KV cache) behind this "
                        "endpoint; needs the `ray` extra")
    s.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (`ray start --head` ...); default: start a local Ray instance")
    s.add_argument("--routing", default="cache_aware", choices=["cache_aware", "least_loaded", "round_robin"],
                   help="how --replicas picks a replica for a request")
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    from tokenhaul.server.app import serve
    from tokenhaul.server.async_engine import AsyncEngine
    from tokenhaul.server.guards import ServerOptions

    options = ServerOptions(args.api_key, tuple(args.allowed_hosts) if args.allowed_hosts else None,
                            tuple(args.allowed_origins or ()), not args.no_docs, args.max_body_bytes,
                            args.header_timeout, args.body_timeout, args.keep_alive_timeout,
                            args.enable_auto_tool_choice, args.tool_call_parser,
                            args.exclude_tools_when_tool_choice_none)
    if args.replicas:
        from tokenhaul.cluster.pool import ReplicaPool

        pool = ReplicaPool(args.model, args.replicas, engine_kwargs(args), args.ray_address, args.routing)
        engine = AsyncEngine.from_client(pool, args.model, args.served_model_name, args.max_waiting,
                                         args.max_prompt_chars, args.request_timeout)
    else:
        engine = AsyncEngine.from_model(args.model, args.served_model_name, args.max_waiting, args.max_prompt_chars,
                                        args.request_timeout, **engine_kwargs(args))
    serve(engine, args.host, args.port, args.log_level, args.access_log, args.shutdown_timeout, options)
