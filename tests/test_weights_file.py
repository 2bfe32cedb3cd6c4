"""The publish folder's safetensors writer: any safetensors reader gets back exactly what was written."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trainers.weights_file import WeightsFileWriter


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "norm": torch.randn(5, generator=g),
        "strided": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "half": torch.randn(3, 3, generator=g).half(),
        "count": torch.tensor(12, dtype=torch.int64),  # zero dimensions
        "empty": torch.empty(0, 3),
        "mask": torch.tensor([True, False, True]),
    }


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 40, 1])
def test_what_is_written_reads_back_exactly_in_one_chunk_or_many(tmp_path, chunk_bytes):
    """Chunks smaller than one tensor (each then goes alone) and one chunk for all write the same file."""
    tensors = _tensors()
    path = tmp_path / "model.safetensors"
    WeightsFileWriter(chunk_bytes=chunk_bytes).write(path, tensors)
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_the_buffer_is_reused_and_a_second_write_does_not_see_the_first(tmp_path):
    writer = WeightsFileWriter()
    writer.write(tmp_path / "a.safetensors", {"w": torch.ones(100)})
    buffer = writer._buffer
    writer.write(tmp_path / "b.safetensors", {"w": torch.full((10,), 2.0)})
    assert writer._buffer is buffer
    assert torch.equal(load_file(str(tmp_path / "b.safetensors"))["w"], torch.full((10,), 2.0))
    assert torch.equal(load_file(str(tmp_path / "a.safetensors"))["w"], torch.ones(100))


def test_a_dtype_safetensors_cannot_hold_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="'z'.*complex64"):
        WeightsFileWriter().write(tmp_path / "x.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        WeightsFileWriter(chunk_bytes=0)
