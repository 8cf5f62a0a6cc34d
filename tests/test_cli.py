"""The command line end to end on the bundled model, and its one-line errors."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from client_runtimes import genai_tokens

import qcompiler as qc
from qcompiler.cli import main
from qcompiler.models import load
from qcompiler.pipeline.recipe_files import resolve_recipe, with_embeddings


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tinylm-w4"
    assert main(["quantize", "bundled:tinylm", "--recipe", "gptq-w4g128", "--samples", "4", "--out", str(out)]) == 0
    return out


def test_quantize_save_load_eval_export_run_agree(artifact, tmp_path, capsys):
    cm = qc.load(artifact)
    assert cm.recipe.name == "gptq-w4g128" and len(cm.report.layer_table()) == 28
    # eval through the CLI equals perplexity computed here from the reloaded artifact
    assert main(["eval", str(artifact), "--windows", "8", "--json", str(tmp_path / "eval.json")]) == 0
    figures = json.loads((tmp_path / "eval.json").read_text())
    from qcompiler.evaluation.quality import QualityJudge

    judge = QualityJudge(load("tinylm"), max_windows=8)
    assert figures["quantized"] == pytest.approx(judge.score(cm), rel=1e-6)
    # 4-bit GPTQ costs little perplexity; on 8 windows it may even gain a little (measured -0.0003),
    # so bound the change from both sides, and check separately that the model did change.
    assert abs(figures["loss"]) < 0.05
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    assert not torch.equal(cm(input_ids=ids).logits, load("tinylm").model(input_ids=ids, use_cache=False).logits)
    # the onnx-genai export of the artifact: its model.onnx computes the reloaded graph's logits in
    # ONNX Runtime, and onnxruntime-genai generates cm.generate's 32 greedy tokens from the folder
    assert (
        main(
            [
                "export",
                str(artifact),
                "--format",
                "onnx-genai",
                "--accuracy-level",
                "0",
                "--out",
                str(tmp_path / "genai"),
            ]
        )
        == 0
    )
    import onnxruntime as ort

    from qcompiler.backends.onnx_export import cache_io_names
    from qcompiler.frontend.causal_lm import graph_inputs

    session = ort.InferenceSession(str(tmp_path / "genai" / "model.onnx"), providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "genai" / "model.onnx")).graph.node]
    assert ops.count("GroupQueryAttention") == 4 and ops.count("MatMulNBits") == 16  # q/k/v and gate/up fused
    # genai's shared-buffer contract: every node's lengths from the mask, no mask tensor of its own
    attention = [
        n for n in onnx.load(str(tmp_path / "genai" / "model.onnx")).graph.node if n.op_type == "GroupQueryAttention"
    ]
    assert {(n.input[5], n.input[6], n.input[10]) for n in attention} == {("qc_seqlens_k", "qc_total_length", "")}
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    inputs = graph_inputs(cm.cache_layout, ids)  # the KV-cache graph, empty past (prefill)
    names = cache_io_names(cm.cache_layout)
    feeds = {
        "input_ids": ids.numpy(),
        "attention_mask": inputs["attention_mask"].numpy(),
        "position_ids": inputs["position_ids"].numpy(),
        **{names[f"past_{i}"]: t.numpy() for i, t in enumerate(inputs["past"])},
    }
    logits = session.run(["logits"], feeds)[0]
    expected = cm(input_ids=ids).logits.numpy()
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-5  # level 0: fp32 activations
    prompt = load("tinylm").encode("class Parser:\n    def __init__(self")
    expected = cm.generate(prompt, 32)[0, prompt.shape[1] :].tolist()
    assert genai_tokens(tmp_path / "genai", prompt[0].tolist(), 32) == expected
    assert sorted(p.name for p in (tmp_path / "genai").iterdir()) == [
        ".qcompiler-output.json",
        "genai_config.json",
        "generation_config.json",
        "model.onnx",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((tmp_path / "genai" / "genai_config.json").read_text())
    assert config["model"]["decoder"]["num_hidden_layers"] == 4 and config["search"]["past_present_share_buffer"]
    # the byte tokenizer travels as Hugging Face files: genai's own tokenizer gives our ids for text
    import onnxruntime_genai as og

    tokenizer, tinylm = og.Tokenizer(og.Model(str(tmp_path / "genai"))), load("tinylm")
    text = "class Parser:\n    def __init__(self, é):  # 日本"
    assert tokenizer.encode(text).tolist() == tinylm.tokenize(text).tolist()
    assert tokenizer.decode(np.asarray(tinylm.tokenize(text), dtype=np.int32)) == text
    assert main(["inspect", str(artifact)]) == 0
    text = capsys.readouterr().out
    assert "qc.quant_linear.default x28" in text and "GPTQ(bits=4" in text


def test_report_writes_plots(artifact, tmp_path):
    assert main(["report", str(artifact), "--out", str(tmp_path / "rep")]) == 0
    page = (tmp_path / "rep" / "report.md").read_text()
    assert "Worst layers" in page and (tmp_path / "rep" / "error.png").stat().st_size > 1000
    assert (tmp_path / "rep" / "bits.png").is_file()


def _one_line_error(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # above it: only library progress bars (weights loading)
    assert last.startswith("error: ") and fragment in last and "Traceback" not in err, err
    return last


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    out = str(tmp_path / "out")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("passes: [\n")
    _one_line_error(capsys, ["quantize", "bundled:tinylm", "--recipe", str(bad_yaml), "--out", out], "not valid YAML")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("passes:\n  - pass: GPTQ\n    group_sise: 64\n")
    _one_line_error(
        capsys, ["quantize", "bundled:tinylm", "--recipe", str(unknown), "--out", out], "did you mean 'group_size'"
    )
    empty_model = tmp_path / "model"
    empty_model.mkdir()
    (empty_model / "config.json").write_text("{}")
    _one_line_error(capsys, ["quantize", str(empty_model), "--out", out], "has no safetensors weights")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    _one_line_error(capsys, ["quantize", "bundled:tinylm", "--calib", str(empty), "--out", out], "is empty")
    binary = tmp_path / "data.bin"
    binary.write_bytes(b"\x00\x01\x02binary")
    _one_line_error(capsys, ["quantize", "bundled:tinylm", "--calib", str(binary), "--out", out], "is not text")
    _one_line_error(capsys, ["inspect", str(tmp_path)], "not a qcompiler artifact")
    assert not (tmp_path / "out").exists()
    with pytest.raises(FileNotFoundError):  # --debug: the real exception, with its traceback
        main(["--debug", "quantize", str(empty_model), "--out", out])


def test_calibration_from_a_text_file(tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(Path(__file__).read_text() * 3)
    assert (
        main(
            [
                "quantize",
                "bundled:tinylm",
                "--recipe",
                "gptq-w4g128",
                "--calib",
                str(text),
                "--samples",
                "4",
                "--out",
                str(tmp_path / "a"),
            ]
        )
        == 0
    )
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["metadata"]["calibration"] == str(text)


def test_export_checkpoints_from_the_cli(artifact, tmp_path):
    from qcompiler import import_gptq

    assert main(["export", str(artifact), "--format", "gptq", "--out", str(tmp_path / "gptq")]) == 0
    assert main(["export", str(artifact), "--format", "compressed-tensors", "--out", str(tmp_path / "ct")]) == 0
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    imported, saved = import_gptq(tmp_path / "gptq"), qc.load(artifact)
    assert torch.equal(imported(input_ids=ids).logits, saved(input_ids=ids).logits)
    # the import runs on the compile pipeline: the KV-cache graphs, so it generates like the artifact
    assert imported.report.passes[0].name == "LoadGPTQCheckpoint"
    assert torch.equal(imported.generate(ids, max_new_tokens=8), saved.generate(ids, max_new_tokens=8))


@pytest.mark.slow
def test_report_of_spqr_has_the_outlier_heat_map(tmp_path):
    art = tmp_path / "spqr"
    assert main(["quantize", "bundled:tinylm", "--recipe", "spqr-w3g16", "--samples", "4", "--out", str(art)]) == 0
    assert main(["report", str(art), "--out", str(tmp_path / "rep")]) == 0
    assert "SpQR outliers" in (tmp_path / "rep" / "report.md").read_text()
    assert (tmp_path / "rep" / "outliers.png").stat().st_size > 1000


def test_generate_streams_the_artifacts_greedy_continuation(artifact, capsys):
    prompt = "class Parser:\n    def __init__(self"
    assert main(["generate", str(artifact), "--prompt", prompt, "--max-new-tokens", "24"]) == 0
    printed = capsys.readouterr().out
    cm, loaded = qc.load(artifact), load("tinylm")
    expected = loaded.decode(cm.generate(loaded.encode(prompt), 24)[0])
    assert printed.rstrip("\n") == expected.rstrip("\n")


@pytest.mark.parametrize("backend", ["eager", pytest.param("onnxruntime", marks=pytest.mark.slow)])
def test_generate_takes_several_prompts_on_any_backend(artifact, backend, capsys):
    assert (
        main(
            [
                "generate",
                str(artifact),
                "--prompt",
                "import os",
                "--prompt",
                "def f(",
                "--max-new-tokens",
                "4",
                "--backend",
                backend,
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "'import os' -> " in printed and "'def f(' -> " in printed


def test_quantize_caps_the_matmul_caches_unless_the_user_chose(artifact, monkeypatch):
    """The quantize command bounds the per-shape caches of CPU bf16 matmuls (MoE calibration fills
    them with new row counts every batch: qcompiler/calib/host_memory.py); a capacity the user set is kept."""
    import os

    from qcompiler.calib.host_memory import KERNEL_CACHE_ENTRIES, bound_kernel_cache

    names = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    assert all(os.environ.get(name) is not None for name in names)  # the fixture's quantize set them
    for name in names:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "8")
    bound_kernel_cache()
    assert os.environ["LRU_CACHE_CAPACITY"] == "8"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(KERNEL_CACHE_ENTRIES)


def test_inspect_escapes_what_the_manifest_says(artifact, tmp_path, capsys):
    """Manifest strings are untrusted: escape sequences (screen clear, OSC 52 clipboard write) are
    printed as visible text, and rich markup in them is not interpreted."""
    import shutil

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["recipe"]["name"] = "\x1b[2J\x1b]52;c;aGk=\x07[bold]evil[/bold]\nFAKE LINE"
    manifest["metadata"]["source"] = "\x9b31m"
    (art / "manifest.json").write_text(json.dumps(manifest))
    assert main(["inspect", str(art)]) == 0
    shown = capsys.readouterr().out
    assert not any(c in shown for c in "\x1b\x07\x9b")
    assert "\\x1b[2J\\x1b]52;c;aGk=\\x07[bold]evil[/bold]\\nFAKE LINE" in shown
    assert "\nFAKE LINE" not in shown


def test_brackets_in_the_output_path_are_text(artifact, tmp_path, capsys):
    """A ``[...]`` in a path is printed as is (rich markup would swallow it or fail after the write)."""
    dest = tmp_path / "ckpt[bold]x[/bold]"
    assert main(["export", str(artifact), "--format", "compressed-tensors", "--out", str(dest)]) == 0
    assert f"wrote {dest}" in capsys.readouterr().out and dest.is_dir()


def test_eval_scores_the_users_text_and_says_over_what(artifact, tmp_path, capsys):
    """``eval --text FILE`` scores that file's windows (the number printed), and the figure equals
    the perplexity of the same windows computed here."""
    from qcompiler.evaluation.eval import perplexity

    text = tmp_path / "mine.txt"
    text.write_text("def parse(line):\n    return line.split(',')\n\n" * 60)
    assert main(["eval", str(artifact), "--text", str(text), "--seqlen", "64", "--json", str(tmp_path / "e.json")]) == 0
    printed = capsys.readouterr().out
    figures = json.loads((tmp_path / "e.json").read_text())
    tokens = load("tinylm").tokenize(text.read_text())
    windows = len(range(0, tokens.numel() - 64, 64))
    assert f"over {windows} windows of 64 tokens of 1 documents given" in printed
    assert figures["quantized"] == pytest.approx(perplexity(qc.load(artifact), tokens, window=64), rel=1e-6)


def test_the_main_job_and_eval_report_the_same_figure_for_the_same_windows(artifact, capsys):
    """Both score 256 windows of the bundled held-out text by default, and say so."""
    from qcompiler.evaluation.quality import QualityJudge

    assert main(["eval", str(artifact), "--windows", "16"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    judge = QualityJudge(load("tinylm"), max_windows=16)
    assert f"over {judge.describe()}: FP32 " in line
    assert f"-> quantized {judge.score(qc.load(artifact)):.4f}" in line


def test_version_debug_anywhere_and_errors_point_at_the_commands_help(capsys):
    from qcompiler.version import __version__

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"qcompiler {__version__}"
    assert main(["quantize", "bundled:tinylm", "--out", "o", "--zero-format", "v1"]) == 2
    line = capsys.readouterr().err.strip()
    assert "--zero-format" in line and line.endswith("(see 'qcompiler quantize --help')")
    with pytest.raises(Exception, match="no-such-recipe"):  # --debug after the command: the traceback
        main(["quantize", "bundled:tinylm", "--recipe", "no-such-recipe", "--out", "o", "--debug"])
    assert main(["export", "x", "--format", "gguf", "--out", "y", "--requantize", "q9_k"]) == 2
    assert "q9_k" in capsys.readouterr().err


def test_bits_group_size_and_ignore_shortcuts_set_the_recipes_passes(tmp_path, capsys):
    from qcompiler.errors import RecipeError
    from qcompiler.pipeline.recipe_files import resolve_recipe, with_overrides

    r = with_overrides(resolve_recipe("gptq-w4g128"), bits=3, group_size=64, ignore=["*.down_proj"])
    (gptq,) = r.passes
    assert (gptq.bits, gptq.group_size, gptq.ignore) == (3, 64, ("*.down_proj",)) and "bits=3" in r.name
    with pytest.raises(RecipeError, match=r"recipe auto:3.25 has no pass with a 'bits' setting"):
        with_overrides(resolve_recipe("auto:3.25"), bits=3)
    with pytest.raises(ValueError, match="bits"):
        with_overrides(resolve_recipe("rtn-w4g128"), bits=17)
    out = tmp_path / "o"
    args = ["quantize", "bundled:tinylm", "--recipe", "rtn-w4g128", "--bits", "3", "--ignore", "*.down_proj"]
    assert main([*args, "--out", str(out)]) == 0
    cm = qc.load(out)
    layers = cm.report.layer_table()
    assert {r["bits"] for r in layers if "bits" in r} == {3} and not any(
        "down_proj" in r["layer"] for r in layers if "bits" in r
    )


def test_embeddings_option_quantizes_the_table_before_the_weight_solves(tmp_path, capsys):
    """``--embeddings w8g128`` puts QuantizeEmbeddings(bits=8, group_size=128) before the recipe's first
    weight-quantizing pass (after rotations, which fold into the table): the saved graph looks tokens
    up in the quantized table; a spec that is not wBITSgGROUP is one line."""
    out = tmp_path / "o"
    args = ["quantize", "bundled:tinylm", "--recipe", "rtn-w4g128", "--embeddings", "w8g128", "--samples", "2"]
    assert main([*args, "--out", str(out)]) == 0
    cm = qc.load(out)
    assert [p.name for p in cm.report.passes] == ["QuantizeEmbeddings", "RTN"]
    rotated = with_embeddings(resolve_recipe("rotate-gptq-w4g128"), "w4g64").passes
    assert [type(p).__name__ for p in rotated] == ["Rotate", "QuantizeEmbeddings", "GPTQ"]
    assert {r["bits"] for r in cm.report.layer_table("QuantizeEmbeddings")} == {8}
    assert any("quant_embedding" in str(n.target) for n in cm.graph_module.graph.nodes)
    assert main(["quantize", "bundled:tinylm", "--embeddings", "w8", "--out", str(tmp_path / "p")]) == 2
    assert "--embeddings 'w8' is not wBITSgGROUP" in capsys.readouterr().err
    # auto: the table joins an auto recipe's budget (tests/test_auto_embeddings.py runs it); refused elsewhere
    (auto,) = with_embeddings(resolve_recipe("auto:4.5"), "auto").passes
    assert auto.embeddings == type(auto).TABLE_SETTINGS and auto.budget == 4.5
    assert main(["quantize", "bundled:tinylm", "--embeddings", "auto", "--out", str(tmp_path / "q")]) == 2
    assert "--embeddings auto puts the table in auto:B's budget" in capsys.readouterr().err


def test_recipes_lists_names_and_shows_one_recipes_passes_and_matches(tmp_path, capsys):
    assert main(["recipes"]) == 0
    listing = capsys.readouterr().out
    assert "gptq-w4g128" in listing and "GPTQ(" not in listing  # names and descriptions only
    assert main(["recipes", "gptq-w4g128"]) == 0
    assert "1. GPTQ(bits=4, group_size=128" in capsys.readouterr().out
    path = tmp_path / "keep.yaml"
    path.write_text("name: r\npasses:\n  - pass: RTN\n    ignore: ['*.down_proj', 'nothing.*']\n")
    assert main(["recipes", str(path), "--model", "bundled:tinylm"]) == 0
    shown = capsys.readouterr().out
    assert "ignore '*.down_proj': 4 layers" in shown and "ignore 'nothing.*': matches nothing" in shown


def test_quantize_with_format_saves_the_artifact_then_exports_it_beside(tmp_path, capsys):
    out = tmp_path / "w4"
    args = ["quantize", "bundled:tinylm", "--recipe", "rtn-w4g128", "--samples", "4", "--out", str(out)]
    assert main([*args, "--format", "gptq"]) == 0
    assert (out / "manifest.json").is_file()
    config = json.loads((tmp_path / "w4-gptq" / "config.json").read_text())
    assert config["quantization_config"]["bits"] == 4
    assert f"wrote {tmp_path / 'w4-gptq'}" in capsys.readouterr().out
    assert main([*args, "--format-out", str(tmp_path / "x")]) == 2
    assert "--format-out names where --format writes" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tinylm", "minilm"])
def test_the_judge_scores_the_same_after_the_fp_model_is_released(name, tmp_path):
    """``eval`` drops the FP model once its figures are in (never resident beside the quantized
    one); the quantized score is unchanged."""
    from qcompiler.evaluation.quality import QualityJudge

    loaded = load(name)
    cm = qc.compile(loaded.model, loaded.example_inputs(), recipe="rtn-w4g128", progress=False)
    judge = QualityJudge(loaded, max_windows=4, sentences=8)
    judge.score(loaded.model)
    before = judge.score(cm)
    judge.release_model()
    assert judge.loaded.model is None
    assert judge.score(cm) == before
