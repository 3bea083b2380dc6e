"""An unreachable --ray-address is one error line, at once: not minutes of Ray's reconnection warnings."""

import pytest

from tokenhaul.cli import main


@pytest.mark.parametrize("address", ["127.0.0.1:1", "localhost:1"])
def test_unreachable_ray_address_is_one_error_line(capsys, monkeypatch, address):
    ray = pytest.importorskip("ray")
    # refused before Ray is asked to connect (which retries for minutes)
    monkeypatch.setattr(ray, "init", lambda *a, **kw: pytest.fail("ray.init was called"))
    with pytest.raises(SystemExit) as e:
        main(["serve", "--replicas", "2", "--threads", "1", "--port", "1", "--ray-address", address])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot reach the Ray cluster at --ray-address {address}") and "\n" not in err
