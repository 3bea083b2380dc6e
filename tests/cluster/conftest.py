"""Cluster tests use the server test kit (tests/server/serverkit.py); the tokenizer fixture is tests/conftest.py's."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
