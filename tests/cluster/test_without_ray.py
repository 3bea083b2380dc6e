"""Without the `ray` extra, --replicas fails with one line naming the extra (nothing is loaded)."""

import sys

import pytest

from tokenhaul.cli import main


def test_replicas_without_ray_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(SystemExit) as e:
        main(["serve", "--replicas", "2", "--port", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --replicas runs engine replicas on Ray, which is not installed: "
                   "pip install 'tokenhaul[ray]'")
