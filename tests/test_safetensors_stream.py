"""The tensor-at-a-time safetensors writer: files the safetensors library reads back bit for bit,
and a tensor that is not what its header announced is refused by name."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from qcompiler.files.safetensors_stream import StreamedTensor, write_streamed


def _entries(tensors):
    return {k: StreamedTensor(v.dtype, tuple(v.shape), lambda v=v: v) for k, v in tensors.items()}


def test_every_dtype_and_shape_reads_back_bit_identical(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 5, generator=g).bfloat16(),
        "f16": torch.randn(7, generator=g).half(),
        "f32_transposed": torch.randn(4, 6, generator=g).t(),  # written contiguous
        "f64": torch.randn(2, 2, generator=g).double(),
        "i32": torch.arange(-5, 6, dtype=torch.int32),
        "i64": torch.tensor([2**40, -3]),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.randint(0, 256, (9,), dtype=torch.uint8, generator=g),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "f8": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
    }
    with open(tmp_path / "t.safetensors", "wb") as f:
        write_streamed(f, _entries(tensors), {"format": "qcompiler-artifact"})
    back = load_file(tmp_path / "t.safetensors")
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert torch.equal(back[k].reshape(-1).view(torch.uint8), v.contiguous().reshape(-1).view(torch.uint8)), k
    with safe_open(tmp_path / "t.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "qcompiler-artifact"}


def test_each_tensor_is_read_only_when_written(tmp_path):
    order = []

    def reader(name, value):
        def read():
            order.append(name)
            return value

        return read

    entries = {
        n: StreamedTensor(torch.float32, (2,), reader(n, torch.full((2,), float(i)))) for i, n in enumerate("abc")
    }
    with open(tmp_path / "t.safetensors", "wb") as f:
        write_streamed(f, entries)
    assert order == ["a", "b", "c"]
    assert load_file(tmp_path / "t.safetensors")["c"].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("value", [torch.zeros(3), torch.zeros(2, dtype=torch.float16)], ids=["shape", "dtype"])
def test_a_tensor_unlike_its_header_is_refused_by_name(tmp_path, value):
    with open(tmp_path / "t.safetensors", "wb") as f, pytest.raises(ValueError, match="tensor model.w: read"):
        write_streamed(f, {"model.w": StreamedTensor(torch.float32, (2,), lambda: value)})


def test_a_dtype_safetensors_lacks_is_refused_by_name(tmp_path):
    with open(tmp_path / "t.safetensors", "wb") as f, pytest.raises(ValueError, match="tensor z: safetensors has no"):
        write_streamed(f, {"z": StreamedTensor(torch.complex64, (1,), lambda: torch.zeros(1, dtype=torch.complex64))})
