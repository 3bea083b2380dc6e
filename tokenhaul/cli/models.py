"""`models`: the catalog's models, installed or not, and `models install ALIAS`."""

from __future__ import annotations

import argparse

from tokenhaul.errors import TokenhaulError
from tokenhaul.models import catalog


def add_parsers(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("models", help="list catalog models (or those named), or `models install ALIAS`")
    m.add_argument("action", nargs="?", choices=["list", "install"], default="list")
    m.add_argument("aliases", nargs="*")
    m.set_defaults(func=cmd_models)


def cmd_models(args: argparse.Namespace) -> None:
    """List the catalog (or the models named), or install the models named: every alias is checked first."""
    unknown = [a for a in args.aliases if a not in catalog.CATALOG]
    if unknown:
        raise TokenhaulError(f"unknown model '{unknown[0]}'; known: {', '.join(catalog.CATALOG)}")
    if args.action == "install":
        if not args.aliases:
            raise TokenhaulError(f"models install needs an alias: one of {', '.join(catalog.CATALOG)}")
        for alias in args.aliases:
            catalog.install(alias)
            files = catalog.resolve(alias)  # joins and verifies once
            print(f"{alias}: installed, verified {files.gguf_path}")
        return
    for row in catalog.listing():
        if args.aliases and row["alias"] not in args.aliases:
            continue
        mark = "installed" if row["installed"] else "not installed"
        star = " (default)" if row["default"] else ""
        print(f"{row['alias']:<20} {mark:<14} {row['size_mb']:>6} MB  {row['description']}{star}")
