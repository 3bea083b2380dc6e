"""A model file's sha256 is checked once: the stamp beside it (size, mtime, sha) is written whole, spares the hash
on later loads, and a place it cannot be written to only costs a re-hash next time."""

from __future__ import annotations

import hashlib
import json

from tokenhaul.models import catalog


def weights(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"weights" * 1000)
    return f, hashlib.sha256(f.read_bytes()).hexdigest()


def test_stamp_spares_the_hash_and_is_written_whole(tmp_path, monkeypatch):
    f, sha = weights(tmp_path)
    hashed = []
    real = catalog.sha256_file
    monkeypatch.setattr(catalog, "sha256_file", lambda p: hashed.append(p) or real(p))
    stamp = tmp_path / "verified.json"
    assert catalog._verified(f, sha, stamp) and len(hashed) == 1
    assert json.loads(stamp.read_text())["sha256"] == sha
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin", "verified.json"]  # no temp file left
    assert catalog._verified(f, sha, stamp) and len(hashed) == 1  # the stamp spared the hash
    assert not catalog._verified(f, "0" * 64, stamp) and len(hashed) == 2  # another sha: hashed, refused


def test_a_stamp_that_cannot_be_written_only_costs_a_rehash(tmp_path):
    f, sha = weights(tmp_path)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    assert catalog._verified(f, sha, not_a_dir / "verified.json")  # writing it fails (even as root): still verified
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "model.bin"]
