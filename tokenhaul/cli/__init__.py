"""tokenhaul command line: the subcommands of each module imported below (its `add_parsers`)."""

from __future__ import annotations

import argparse
import sys

from tokenhaul.cli import bench, calibrate, eval_ppl, generate, models, serve, trace, whatif
from tokenhaul.cli.args import add_engine_args, add_sampling_args, engine_kwargs, sampling_params
from tokenhaul.cli.generate import options_line
from tokenhaul.errors import TokenhaulError

__all__ = ["add_engine_args", "add_sampling_args", "build_parser", "engine_kwargs", "main", "options_line",
           "sampling_params"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenhaul")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, models, serve, bench, trace, whatif, eval_ppl, calibrate):  # the order --help lists
        command.add_parsers(sub)
    parser.description = f"tokenhaul command line: {' | '.join(_commands(sub))}."
    return parser


def _commands(sub: argparse._SubParsersAction) -> list[str]:
    """Every subcommand's name; one with subcommands of its own, as each of those ('bench serve')."""
    names = []
    for name, p in sub.choices.items():
        nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        names += [f"{name} {n}" for n in nested[0].choices] if nested else [name]
    return names


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except TokenhaulError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
