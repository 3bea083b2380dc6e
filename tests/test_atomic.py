"""atomic_path: the target is replaced whole or not at all; each writer has its own temp file."""

from __future__ import annotations

import threading

import pytest

from tokenhaul.atomic import atomic_path


def test_target_appears_only_when_complete(tmp_path):
    target = tmp_path / "table.json"
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp != target
        tmp.write_text("half")
        assert not target.exists()  # nothing at the target while writing
        with tmp.open("a") as f:
            f.write(" and whole")
    assert target.read_text() == "half and whole"
    assert list(tmp_path.iterdir()) == [target]


def test_replaces_existing_target(tmp_path):
    target = tmp_path / "table.json"
    target.write_text("old")
    with atomic_path(target) as tmp:
        tmp.write_text("new")
        assert target.read_text() == "old"
    assert target.read_text() == "new"
    assert list(tmp_path.iterdir()) == [target]


def test_exception_removes_temp_and_keeps_target(tmp_path):
    target = tmp_path / "table.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="writer failed"), atomic_path(target) as tmp:
        tmp.write_text("partial")
        raise RuntimeError("writer failed")
    assert target.read_text() == "old"
    assert list(tmp_path.iterdir()) == [target]


def test_exception_before_writing_leaves_nothing(tmp_path):
    target = tmp_path / "table.json"
    with pytest.raises(ValueError), atomic_path(target):
        raise ValueError
    assert list(tmp_path.iterdir()) == []


def test_suffix_ends_temp_name(tmp_path):
    with atomic_path(tmp_path / "step.pt2", suffix=".pt2") as tmp:
        assert tmp.name.endswith(".pt2") and tmp.name != "step.pt2"
        tmp.write_bytes(b"x")
    assert (tmp_path / "step.pt2").read_bytes() == b"x"


def test_writers_in_two_threads_use_different_temp_names(tmp_path):
    target = tmp_path / "table.json"
    names: list[str] = []
    both_open = threading.Barrier(2)

    def write(text: str) -> None:
        with atomic_path(target) as tmp:
            names.append(tmp.name)
            tmp.write_text(text)
            both_open.wait(timeout=10)  # both temp files exist at once

    threads = [threading.Thread(target=write, args=(t,)) for t in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(names)) == 2
    assert target.read_text() in ("a", "b")
    assert list(tmp_path.iterdir()) == [target]
