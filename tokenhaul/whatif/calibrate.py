"""Calibration: this machine's read bandwidth (from DRAM, and from a buffer that stays in the last-level cache)
and fp32 GEMM FLOP/s, measured once and cached.

Cached in `<cache root>/calibration.json`, one entry per CPU model | thread count | device, so the
ledger's roofline follows `torch.set_num_threads` and the device in use. `machine_roofline` is what
the ledger calls: it measures (a few seconds) only when no entry exists."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tokenhaul.atomic import atomic_path
from tokenhaul.host import cpu_model, llc_bytes
from tokenhaul.models.catalog import cache_root
from tokenhaul.whatif import clock
from tokenhaul.whatif.roofline import Roofline

CALIBRATION_FILE = "calibration.json"
STREAMS = 32  # read streams per thread in the second bandwidth pass
METHOD = 3  # entries measured another way (1: one stream only; 2: no cache-resident pass) are measured again
_memo: dict[str, Roofline] = {}


def machine_key(device: str = "cpu", threads: int | None = None) -> str:
    threads = threads or torch.get_num_threads()
    dev = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device
    return f"{cpu_model()} | threads={threads} | {dev}"


def calibration_path(root: Path | None = None) -> Path:
    return (root or cache_root()) / CALIBRATION_FILE


def measure_bandwidth(device: str = "cpu", nbytes: int = 2**30, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s over `nbytes` (1 GiB ≫ any cache): the best of a plain `sum` (one stream of
    reads per thread) and a sum of the same bytes as 32 rows (32 streams per thread). One stream leaves a core's
    memory-level parallelism unused on some hosts (a Sapphire Rapids guest: 21 vs 30 GB/s, bench/RESULTS.md)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum()  # touch every page before timing
    rows = x.view(STREAMS, -1)
    out = torch.empty(rows.shape[1], dtype=torch.float32, device=device)
    one = clock.best_seconds(x.sum, device, repeats, warmup=0)
    many = clock.best_seconds(lambda: torch.sum(rows, 0, out=out), device, repeats, warmup=1)
    return nbytes / min(one, many)


def measure_flops(device: str = "cpu", n: int | None = None, repeats: int = 3) -> float:
    """fp32 GEMM FLOP/s: best time of an n×n @ n×n matmul (2048 on a CPU, 8192 on a GPU)."""
    n = n or (8192 if device.startswith("cuda") else 2048)
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b  # warm up the BLAS
    return 2 * n**3 / clock.best_seconds(lambda: a @ b, device, repeats, warmup=0)


def measure(device: str = "cpu", nbytes: int = 2**30, gemm_n: int | None = None) -> dict:
    t = time.perf_counter()
    bandwidth = measure_bandwidth(device, nbytes)
    flops = measure_flops(device, gemm_n)
    resident = (llc_bytes() // 2) // (STREAMS * 4 * 1024) * (STREAMS * 4 * 1024) if device == "cpu" else 0
    resident_bw = measure_bandwidth(device, resident) if resident else 0.0  # the buffer read again: in cache
    return {"bandwidth_gb_per_s": bandwidth / 1e9, "gflop_per_s": flops / 1e9, "method": METHOD,
            "resident_bytes": resident, "resident_gb_per_s": resident_bw / 1e9,
            "threads": torch.get_num_threads(), "device": device, "measured_at": time.time(),
            "measure_seconds": time.perf_counter() - t}


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def load_entry(key: str, root: Path | None = None) -> dict | None:
    return _load(calibration_path(root)).get(key)


def store_entry(key: str, entry: dict, root: Path | None = None) -> None:
    """Write one entry into the cache file (mutates it; atomic replace)."""
    path = calibration_path(root)
    table = _load(path)
    table[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))


def calibrate(device: str = "cpu", root: Path | None = None, **measure_kw) -> tuple[Roofline, dict]:
    """Measure now and store the entry for this machine key (mutates the cache file)."""
    key = machine_key(device)
    entry = measure(device, **measure_kw)
    store_entry(key, entry, root)
    roof = _roofline(key, entry)
    _memo[f"{root}|{key}"] = roof
    return roof, entry


def machine_roofline(device: str = "cpu", root: Path | None = None) -> Roofline:
    """This machine's roofline for the current thread count: from the cache file, else measured now."""
    key = machine_key(device)
    memo = f"{root}|{key}"
    if memo not in _memo:
        entry = load_entry(key, root)
        fresh = entry is not None and entry.get("method") == METHOD
        _memo[memo] = _roofline(key, entry) if fresh else calibrate(device, root)[0]
    return _memo[memo]


def _roofline(key: str, entry: dict) -> Roofline:
    return Roofline(entry["bandwidth_gb_per_s"] * 1e9, entry["gflop_per_s"] * 1e9, key,
                    entry.get("resident_bytes", 0), entry.get("resident_gb_per_s", 0.0) * 1e9)
