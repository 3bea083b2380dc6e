"""Converted linears cached as safetensors beside the model, so a restart does not convert again.

The file name carries what the conversion depends on: the GGUF (name and size), the quantization, the
device type, and the torch version + CPU capability (the packed int4 layout is the kernel's own)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenhaul.atomic import atomic_path
from tokenhaul.layers.linear import Linear
from tokenhaul.layers.quantization import QuantSpec


class WeightCache:
    def __init__(self, cache_dir: Path, gguf_path: Path, spec: QuantSpec, device: str) -> None:
        dev = torch.device(device).type
        arch = torch.backends.cpu.get_cpu_capability() if dev == "cpu" else dev
        tag = f"{gguf_path.stem}.{gguf_path.stat().st_size}.{str(spec).replace(':', 'g')}.{dev}.{arch}"
        self.path = Path(cache_dir) / f"{tag}.torch{torch.__version__.split('+')[0]}.safetensors"

    def load(self) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
        """name → (format, state); empty when nothing is cached (or the file is unreadable)."""
        if not self.path.exists():
            return {}
        try:
            from safetensors import safe_open

            with safe_open(str(self.path), "pt") as f:
                formats = f.metadata() or {}
            flat = load_file(str(self.path))
        except Exception:  # noqa: BLE001 - a damaged cache is rebuilt, never fatal
            return {}
        out: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}
        for key, t in flat.items():
            name, _, field = key.rpartition("/")
            # a fresh copy: safetensors' buffers are 8-byte aligned, and the packed kernels crash on that
            out.setdefault(name, (formats.get(name, ""), {}))[1][field] = t.clone()
        return out

    def save(self, linears: dict[str, Linear]) -> None:
        """Write every converted linear (atomically: a half-written file is never read)."""
        flat = {f"{name}/{k}": v.detach().cpu().contiguous() for name, lin in linears.items()
                for k, v in lin.state().items()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(self.path) as tmp:
                save_file(flat, str(tmp), metadata={name: lin.format for name, lin in linears.items()})
        except OSError:
            pass  # a read-only cache dir: run without the cache
