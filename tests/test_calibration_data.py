"""Calibration from every input kind equals calibration from the equivalent token tensor."""

import json
import warnings

import pytest
import torch

import qcompiler as qc
from qcompiler.calib.calibration_data import calibration_batches
from qcompiler.cli import main
from qcompiler.models import load

DOCS = [
    "def add(a, b):\n    return a + b\n" * 12,
    "class Stack:\n    def push(self, x):\n        pass\n" * 10,
    "import os\nprint(os.getcwd())\n" * 15,
]


@pytest.fixture(scope="module")
def tinylm():
    return load("tinylm")


def _expected(nsamples, seqlen, seed):
    """The GPTQ paper's recipe written out directly on the token tensor."""
    stream = torch.cat([torch.tensor(list(d.encode())) for d in DOCS])
    starts = torch.randint(0, stream.numel() - seqlen + 1, (nsamples,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([stream[s : s + seqlen] for s in starts.tolist()])


def _sources(tmp_path):
    (tmp_path / "docs").mkdir()
    for i, d in enumerate(DOCS):
        (tmp_path / "docs" / f"{i}.txt").write_text(d)
    (tmp_path / "one.txt").write_text("".join(DOCS))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    sources = {
        "list": DOCS,
        "folder": tmp_path / "docs",
        "text file": tmp_path / "one.txt",
        "jsonl": tmp_path / "d.jsonl",
    }
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS}), tmp_path / "d.parquet")
        sources["parquet"] = tmp_path / "d.parquet"
    except ImportError:
        pass
    return sources


def test_every_input_kind_gives_the_token_tensor_windows(tinylm, tmp_path):
    expected = _expected(6, 64, seed=3)
    for kind, source in _sources(tmp_path).items():
        batches = calibration_batches(tinylm, source, nsamples=6, seqlen=64, seed=3, batch_size=4)
        assert torch.equal(torch.cat([b["input_ids"] for b in batches]), expected), kind


def test_same_calibration_gives_the_same_quantized_model(tinylm):
    from_text = calibration_batches(tinylm, DOCS, nsamples=4, seqlen=64, seed=1)
    from_tensor = [{"input_ids": _expected(4, 64, seed=1)}]
    a = qc.compile(tinylm.model, tinylm.example_inputs(), recipe="gptq-w4g128", calibration=from_text, progress=False)
    b = qc.compile(tinylm.model, tinylm.example_inputs(), recipe="gptq-w4g128", calibration=from_tensor, progress=False)
    ids = _expected(1, 32, seed=9)
    assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)  # identical Hessians, identical GPTQ


def test_too_little_text_is_an_error_or_a_warning_with_the_count(tinylm):
    tokens = sum(len(d.encode()) for d in DOCS)
    with pytest.raises(ValueError, match="has 300 tokens, fewer than one window of 512"):
        calibration_batches(tinylm, ["abc" * 100], nsamples=2, seqlen=4096)  # capped at the context: 512
    with pytest.warns(UserWarning, match=rf"has {tokens} tokens, fewer than nsamples x seqlen = 64 x 256"):
        calibration_batches(tinylm, DOCS, nsamples=64, seqlen=256)


def test_packing_none_gives_one_masked_sample_per_document(tinylm):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (batch,) = calibration_batches(tinylm, DOCS + ["x" * 7], nsamples=4, seqlen=100, packing="none", seed=0)
    assert sorted(batch["attention_mask"].sum(1).tolist()) == [7, 100, 100, 100]  # cut at seqlen, short one padded
    for row, mask in zip(batch["input_ids"], batch["attention_mask"]):
        text = bytes(row[mask.bool()].tolist()).decode()
        assert any(d.startswith(text) for d in DOCS + ["x" * 7]) and not row[~mask.bool()].any()


def test_bad_sources_name_the_problem(tinylm, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2 has no string field 'text'"):
        calibration_batches(tinylm, tmp_path / "bad.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no text files"):
        calibration_batches(tinylm, tmp_path / "empty")
    with pytest.raises(ValueError, match="packing must be"):
        calibration_batches(tinylm, DOCS, packing="bins")
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):  # not silently the default
        calibration_batches(tinylm, DOCS, batch_size=0)


def test_cli_calibrates_from_jsonl(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS))
    assert (
        main(
            [
                "quantize",
                "bundled:tinylm",
                "--recipe",
                "gptq-w4g128",
                "--calib",
                str(tmp_path / "d.jsonl"),
                "--calib-field",
                "body",
                "--nsamples",
                "4",
                "--seqlen",
                "64",
                "--out",
                str(tmp_path / "a"),
            ]
        )
        == 0
    )
    metadata = json.loads((tmp_path / "a" / "manifest.json").read_text())["metadata"]
    assert metadata["seqlen"] == 64 and metadata["samples"] == 4


def test_hostile_calibration_files_are_refused_before_they_are_read(tinylm, tmp_path, monkeypatch, capsys):
    """A link to /dev/zero or a FIFO (a reader would never end or block), a 2 GB sparse file (read whole
    into memory and tokenized before its first window) and a folder whose files add up past the
    bound: each one line naming the file, nothing read; a link to a real text file still reads."""
    import os

    from qcompiler.calib import calibration_data
    from qcompiler.calib.calibration_data import TEXT_LIMIT, read_texts

    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.jsonl")
    with open(tmp_path / "sparse.txt", "wb") as f:
        f.truncate(2 << 30)
    for name, words in (
        ("zero.txt", "is not a regular file (it is a character device)"),
        ("fifo.jsonl", "is not a regular file (it is a FIFO)"),
        ("sparse.txt", f"is over the {TEXT_LIMIT >> 20} MiB of calibration text qcompiler reads"),
    ):
        with pytest.raises(
            ValueError, match=rf"calibration file \S+/{name} " + words.replace("(", r"\(").replace(")", r"\)")
        ):
            read_texts(tmp_path / name)
    code = main(["quantize", "bundled:tinylm", "--calib", str(tmp_path / "zero.txt"), "--out", str(tmp_path / "o")])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[qcompiler]")]
    assert code == 2 and len(err) == 1 and "zero.txt is not a regular file" in err[0]
    assert not (tmp_path / "o").exists()
    (tmp_path / "docs").mkdir()
    for i in range(3):
        (tmp_path / "docs" / f"{i}.txt").write_text("x" * 400)
    monkeypatch.setattr(calibration_data, "TEXT_LIMIT", 1000)  # the bound covers the files together
    with pytest.raises(ValueError, match=r"docs/2\.txt is over the"):
        read_texts(tmp_path / "docs")
    (tmp_path / "real.txt").write_text(DOCS[0])
    (tmp_path / "link.txt").symlink_to(tmp_path / "real.txt")
    assert read_texts(tmp_path / "link.txt") == [DOCS[0]]
