"""The struct reader of GGUF files (models/gguf_file.py) against gguf's own GGUFReader: the same metadata
and the same tensors, byte for byte, on a real model; a foreign file is one clear error."""

from __future__ import annotations

import numpy as np
import pytest

from tokenhaul.errors import ModelError
from tokenhaul.models.catalog import is_installed, resolve
from tokenhaul.models.gguf_file import MAX_ARRAY, GGUFFile


def test_not_a_gguf(tmp_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ModelError, match="is not a readable GGUF file"):
        GGUFFile(bad)
    bad.write_bytes(b"GGUF" + bytes(8))  # cut short
    with pytest.raises(ModelError, match="is not a readable GGUF file"):
        GGUFFile(bad)


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-135m"])
def test_same_metadata_and_tensors_as_gguf_reader(name: str) -> None:
    if not is_installed(name):
        pytest.skip(f"{name} not installed")
    from gguf import GGUFReader, GGUFValueType

    path = resolve(name).gguf_path
    reader, ours = GGUFReader(path), GGUFFile(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")
                and not (f.types[0] == GGUFValueType.ARRAY and len(f.data) > MAX_ARRAY)}
    assert ours.metadata.keys() == expected.keys()
    for k, v in expected.items():
        assert ours.metadata[k] == pytest.approx(v) if not isinstance(v, str) else ours.metadata[k] == v, k
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for a, b in zip(ours.tensors, reader.tensors):
        assert (a.tensor_type, a.shape, a.n_elements) == (b.tensor_type, tuple(int(d) for d in b.shape),
                                                          int(b.n_elements)), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
