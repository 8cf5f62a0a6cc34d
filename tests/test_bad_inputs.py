"""The bad-input catalogue: one row per case, each a one-line message with a documented exit code,
and nothing changed on disk (the working folder is hashed before and after).

CLI rows: (id, argv template, exit code, words the message must contain). ``{x}`` placeholders
name prepared inputs (see ``_prepare``). API rows: (id, callable, exception type, words).
docs/reliability.md lists the same cases with their outcomes.
"""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import example_inputs, make_model

import qcompiler as qc
from qcompiler.cli import main
from qcompiler.errors import BackendError, CalibrationError, CaptureError, RecipeError
from qcompiler.files.atomic import OutputPathError
from qcompiler.store.graph_format import ArtifactError

BOMB = (
    'a: &a ["x","x","x","x","x","x","x","x","x"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n'
    "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\npasses: [*c]\n"
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Every prepared input, written once; rows only read them."""
    root = tmp_path_factory.mktemp("catalogue")
    files = {}

    def text(name, content, mode="w"):
        path = root / name
        path.write_bytes(content) if mode == "wb" else path.write_text(content)
        files[name.replace(".", "_")] = path

    text("bad.yaml", "passes: [\n")
    text("typo.yaml", "passes:\n  - pass: GPTQ\n    group_sise: 64\n")
    text("bits.yaml", "passes:\n  - pass: RTN\n    bits: '4'\n")
    text("nopass.yaml", "passes:\n  - pass: not_installed_anywhere:MyPass\n")
    text("ignoreall.yaml", "passes:\n  - pass: RTN\n    ignore: ['*']\n")
    text("bomb.yaml", BOMB)
    text("huge.yaml", "#" * (2 << 20))
    text("recipe.json", "{}")
    text("empty.txt", "  \n")
    text("binary.bin", b"\x00\x01binary", "wb")
    text("latin1.txt", "caf\xe9 ".encode("latin-1") * 10, "wb")
    text("afile", "not a folder")
    model = make_model("llama")
    good = root / "model"
    model.save_pretrained(good)
    files["model"] = good
    for name in (
        "nocfg",
        "pickle",
        "missing",
        "custom",
        "manylayers",
        "truncw",
        "badtok",
        "wshape",
        "int32w",
        "hugehdr",
        "vocab0",
        "heads0",
    ):
        shutil.copytree(good, root / name)
        files[name] = root / name
    (root / "nocfg" / "config.json").unlink()
    for f in (root / "pickle").glob("*.safetensors"):
        f.unlink()
    (root / "pickle" / "pytorch_model.bin").write_bytes(b"pickle")
    weights = next((root / "missing").glob("*.safetensors"))
    tensors = load_file(weights)
    tensors.pop("model.layers.1.mlp.down_proj.weight")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config = json.loads((root / "manylayers" / "config.json").read_text())
    config["num_hidden_layers"] = 1_000_000
    (root / "manylayers" / "config.json").write_text(json.dumps(config))
    (root / "badtok" / "tokenizer.json").write_text("{not json")
    for name, key in (("vocab0", "vocab_size"), ("heads0", "num_attention_heads")):
        config = json.loads((root / name / "config.json").read_text())
        config[key] = 0
        (root / name / "config.json").write_text(json.dumps(config))
    weights = next((root / "wshape").glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(5, 5)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    weights = next((root / "int32w").glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.ones(128, 64, dtype=torch.int32)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    weights = next((root / "hugehdr").glob("*.safetensors"))
    weights.write_bytes((10**12).to_bytes(8, "little") + b"{}")  # a header "a terabyte long"
    weights = next((root / "truncw").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:5000])
    config = json.loads((root / "custom" / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    (root / "custom" / "config.json").write_text(json.dumps(config))
    (root / "custom" / "configuration_evil.py").write_text(f"open({str(root / 'PWNED')!r}, 'w')\n")
    victim = root / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("thesis")
    files["victim"] = victim
    (root / "link").symlink_to(victim)
    files["link"] = root / "link"
    thesis = root / "thesis.onnx"
    thesis.write_text("my thesis")
    files["thesis"] = thesis
    cm = qc.compile(model, example_inputs("llama"), recipe="rtn-w4g128", progress=False)
    cm.save(root / "art")
    files["art"] = root / "art"
    cm.save(root / "added")  # an earlier output a user then added a file to
    (root / "added" / "notes.txt").write_text("my notes")
    files["added"] = root / "added"
    int8 = qc.compile(make_model("llama"), example_inputs("llama"), recipe="w8a8", progress=False)
    int8.save(root / "int8")
    files["int8"] = root / "int8"
    for name, damage in (
        ("badjson", lambda p: (p / "manifest.json").write_text("{")),
        ("corrupt", _flip_tensor_byte),
        ("traversal", _traverse),
        ("version", lambda p: _edit_manifest(p, version=99)),
        ("payload", _inject),
        ("truncated", _truncate),
    ):
        shutil.copytree(root / "art", root / name)
        damage(root / name)
        files[name] = root / name
    files["root"] = root
    return files


def _edit_manifest(path, **changes):
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(changes)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _flip_tensor_byte(path):
    data = bytearray((path / "tensors.safetensors").read_bytes())
    data[-3] ^= 1
    (path / "tensors.safetensors").write_bytes(bytes(data))


def _truncate(path):
    data = (path / "tensors.safetensors").read_bytes()
    (path / "tensors.safetensors").write_bytes(data[: len(data) // 2])


def _traverse(path):
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["graph"] = "../../../etc/passwd"
    (path / "manifest.json").write_text(json.dumps(manifest))


def _inject(path):
    graph = json.loads((path / "graph.json").read_text())
    graph["pytree"]["orig_args"].append("x=__import__('os').system('id')")
    (path / "graph.json").write_text(json.dumps(graph))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["sha256"]["graph.json"] = hashlib.sha256((path / "graph.json").read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))


Q = ["quantize", "{model}", "--recipe", "rtn-w4g128", "--samples", "2"]
CLI_ROWS = [
    # usage errors
    ("unknown command", ["frobnicate"], 2, "No such command"),
    ("quantize without model", ["quantize"], 2, "Missing argument"),
    ("quantize without --out", ["quantize", "bundled:tinylm"], 2, "Missing option '--out'"),
    ("unknown option", ["recipes", "--bogus"], 2, "No such option"),
    (
        "bad --format choice",
        ["export", "{art}", "--format", "zip", "--out", "{root}/o"],
        2,
        "Invalid value for '--format'",
    ),
    (
        "non-integer --samples",
        ["quantize", "bundled:tinylm", "--samples", "many", "--out", "{root}/o"],
        2,
        "Invalid value for '--samples'",
    ),
    ("bad --backend choice", ["eval", "{art}", "--backend", "tpu"], 2, "Invalid value for '--backend'"),
    # recipes
    ("unknown recipe name", ["quantize", "bundled:tinylm", "--recipe", "gptq-w5", "--out", "{root}/o"], 2, "gptq-w5"),
    ("unknown device", ["quantize", "bundled:tinylm", "--device", "tpu7", "--out", "{root}/o"], 2, "device='tpu7'"),
    (
        "recipe: invalid YAML",
        ["quantize", "bundled:tinylm", "--recipe", "{bad_yaml}", "--out", "{root}/o"],
        2,
        "not valid YAML",
    ),
    (
        "recipe: misspelt key",
        ["quantize", "bundled:tinylm", "--recipe", "{typo_yaml}", "--out", "{root}/o"],
        2,
        "did you mean 'group_size'",
    ),
    (
        "recipe: wrong type",
        ["quantize", "bundled:tinylm", "--recipe", "{bits_yaml}", "--out", "{root}/o"],
        2,
        "must be int",
    ),
    (
        "recipe: YAML alias bomb",
        ["quantize", "bundled:tinylm", "--recipe", "{bomb_yaml}", "--out", "{root}/o"],
        2,
        "aliases",
    ),
    (
        "recipe: huge file",
        ["quantize", "bundled:tinylm", "--recipe", "{huge_yaml}", "--out", "{root}/o"],
        2,
        "limited to",
    ),
    (
        "recipe: wrong extension",
        ["quantize", "bundled:tinylm", "--recipe", "{recipe_json}", "--out", "{root}/o"],
        2,
        ".toml file",
    ),
    (
        "recipe: missing file",
        ["quantize", "bundled:tinylm", "--recipe", "{root}/no.yaml", "--out", "{root}/o"],
        2,
        "does not exist",
    ),
    (
        "recipe: user pass not importable",
        ["quantize", "bundled:tinylm", "--recipe", "{nopass_yaml}", "--out", "{root}/o"],
        2,
        "cannot import module 'not_installed_anywhere'",
    ),
    (
        "recipe: quantizes nothing",
        ["quantize", "bundled:tinylm", "--recipe", "{ignoreall_yaml}", "--samples", "2", "--out", "{root}/o"],
        2,
        "RTN provides QUANTIZED_WEIGHTS",
    ),
    # model folders
    ("model: missing folder", ["quantize", "{root}/nothing", "--out", "{root}/o"], 2, "does not exist"),
    (
        "model: wrong-shape tensor, streamed",
        ["quantize", "{wshape}", "--recipe", "rtn-w4g128", "--out", "{root}/o"],
        2,
        "wrong shape for model.layers.0.mlp.up_proj.weight ([5, 5], the model expects [128, 64])",
    ),
    (
        "model: wrong-shape tensor, --no-stream",
        ["quantize", "{wshape}", "--recipe", "rtn-w4g128", "--no-stream", "--out", "{root}/o"],
        2,
        "the checkpoint has the wrong shape for model.layers.0.mlp.up_proj.weight",
    ),
    *(
        (
            f"model: int32 weight tensor{label}",
            ["quantize", "{int32w}", "--recipe", "rtn-w4g128", *flags, "--out", "{root}/o"],
            2,
            "stores model.layers.0.mlp.up_proj.weight as I32, not a floating-point type",
        )
        for label, flags in ((", streamed", ()), (", --no-stream", ("--no-stream",)))
    ),
    (
        "model: safetensors header claims a terabyte",
        ["quantize", "{hugehdr}", "--out", "{root}/o"],
        2,
        "model.safetensors is not a readable safetensors file (Error while deserializing header: header too large)",
    ),
    (
        "model: vocab_size 0",
        ["quantize", "{vocab0}", "--out", "{root}/o"],
        2,
        "config.json has vocab_size=0; it must be a positive integer",
    ),
    (
        "model: num_attention_heads 0",
        ["quantize", "{heads0}", "--out", "{root}/o"],
        2,
        "transformers cannot build its config from config.json (ZeroDivisionError",
    ),
    (
        "model: tokenizer.json not JSON",
        ["quantize", "{badtok}", "--recipe", "rtn-w4g128", "--out", "{root}/o"],
        2,
        "badtok are not valid JSON (Expecting property name enclosed in double quotes at line 1, column 2)",
    ),
    ("model: no config.json", ["quantize", "{nocfg}", "--out", "{root}/o"], 2, "no config.json"),
    ("model: pickle weights only", ["quantize", "{pickle}", "--out", "{root}/o"], 2, "pickle checkpoints"),
    (
        "model: a tensor missing",
        [*Q[:1], "{missing}", *Q[2:], "--out", "{root}/o"],
        2,
        "model.layers.1.mlp.down_proj.weight",
    ),
    ("model: ships custom code", ["quantize", "{custom}", "--out", "{root}/o"], 2, "never runs code"),
    ("model: 1,000,000 layers claimed", ["quantize", "{manylayers}", "--out", "{root}/o"], 2, "says 1000000 layers"),
    ("model: truncated weights", ["quantize", "{truncw}", "--out", "{root}/o"], 2, "not a readable safetensors"),
    ("eval --windows -5", ["eval", "bundled:tinylm", "--windows", "-5"], 2, "Invalid value for '--windows'"),
    ("--samples 0", ["quantize", "bundled:tinylm", "--samples", "0", "--out", "{root}/o"], 2, "'--samples'"),
    ("generate --top-p 2", ["generate", "bundled:tinylm", "--prompt", "x", "--top-p", "2"], 2, "'--top-p'"),
    ("model: a file, not a folder", ["quantize", "{afile}", "--out", "{root}/o"], 2, "does not exist"),
    # calibration
    (
        "calib: missing file",
        ["quantize", "bundled:tinylm", "--calib", "{root}/none.txt", "--out", "{root}/o"],
        2,
        "does not exist",
    ),
    ("calib: empty", ["quantize", "bundled:tinylm", "--calib", "{empty_txt}", "--out", "{root}/o"], 2, "is empty"),
    ("calib: binary", ["quantize", "bundled:tinylm", "--calib", "{binary_bin}", "--out", "{root}/o"], 2, "is not text"),
    (
        "calib: not UTF-8",
        ["quantize", "bundled:tinylm", "--calib", "{latin1_txt}", "--out", "{root}/o"],
        2,
        "not UTF-8",
    ),
    # output paths
    ("--out holds user files", ["quantize", "bundled:tinylm", "--out", "{victim}"], 2, "precious.txt"),
    ("--out is .", ["quantize", "bundled:tinylm", "--out", "."], 2, "refusing to write"),
    ("--out is the cwd", ["quantize", "bundled:tinylm", "--out", "{cwd}"], 2, "current folder"),
    ("--out is an ancestor of cwd", ["quantize", "bundled:tinylm", "--out", "{cwd}/.."], 2, "refusing to write"),
    ("--out is /", ["quantize", "bundled:tinylm", "--out", "/", "--overwrite"], 2, "refusing to write"),
    ("--out is home", ["quantize", "bundled:tinylm", "--out", "{home}", "--overwrite"], 2, "home folder"),
    ("--out is the input model", ["quantize", "{model}", "--out", "{model}", "--overwrite"], 2, "holds the input"),
    ("--out is a file", ["quantize", "bundled:tinylm", "--out", "{afile}"], 2, "it is a file"),
    ("--out holds user files, --overwrite", [*Q, "--out", "{victim}", "--overwrite"], 2, "precious.txt"),
    ("--out: a file added to an output", [*Q, "--out", "{added}"], 2, "did not write (notes.txt)"),
    ("--out: added file, --overwrite", [*Q, "--out", "{added}", "--overwrite"], 2, "notes.txt"),
    ("--out is home's parent", [*Q, "--out", "{home_parent}", "--overwrite"], 2, "home folder or one of its parents"),
    ("--out in a system folder", [*Q, "--out", "/usr/qcompiler-never-there", "--overwrite"], 2, "system folder /usr"),
    ("--out directly under /", [*Q, "--out", "/srv", "--overwrite"], 2, "directly under it"),
    (
        "export gptq over the model, --overwrite",
        ["export", "{art}", "--format", "gptq", "--out", "{model}", "--overwrite"],
        2,
        "did not write (config.json",
    ),
    (
        "export onnx over the weights",
        ["export", "{art}", "--format", "onnx", "--out", "{model}/model.safetensors", "--overwrite"],
        2,
        "ONNX writer did not write it",
    ),
    (
        "export onnx into the artifact",
        ["export", "{art}", "--format", "onnx", "--out", "{art}/model.onnx"],
        2,
        "lies in the input",
    ),
    (
        "export onnx into another output",
        ["export", "{art}", "--format", "onnx", "--out", "{int8}/model.onnx"],
        2,
        "lies in the qcompiler artifact output",
    ),
    ("report over the model, --overwrite", ["report", "{art}", "--out", "{model}", "--overwrite"], 2, "config.json"),
    ("eval --json over config.json", ["eval", "{model}", "--json", "{model}/config.json"], 2, "lies in the input"),
    (
        "eval --json over a manifest",
        ["eval", "{model}", "--json", "{art}/manifest.json"],
        2,
        "qcompiler artifact output",
    ),
    ("eval --json over a user file", ["eval", "{model}", "--json", "{thesis}"], 2, "eval JSON writer did not write"),
    ("--out is a symlink", ["quantize", "bundled:tinylm", "--out", "{link}"], 2, "symbolic link"),
    ("export gptq over user files", ["export", "{art}", "--format", "gptq", "--out", "{victim}"], 2, "precious.txt"),
    (
        "export c-t over user files",
        ["export", "{art}", "--format", "compressed-tensors", "--out", "{victim}"],
        2,
        "precious.txt",
    ),
    (
        "export c-t into the artifact",
        ["export", "{art}", "--format", "compressed-tensors", "--out", "{art}"],
        2,
        "holds the input",
    ),
    (
        "export onnx over a user file",
        ["export", "{art}", "--format", "onnx", "--out", "{thesis}"],
        2,
        "ONNX writer did not write it",
    ),
    ("export onnx to a folder", ["export", "{art}", "--format", "onnx", "--out", "{victim}"], 2, "it is a folder"),
    (
        "export gguf over a user file",
        ["export", "{art}", "--format", "gguf", "--out", "{thesis}"],
        2,
        "GGUF writer did not write it",
    ),
    (
        "export gguf: not a GGUF grid",
        ["export", "{art}", "--format", "gguf", "--out", "{root}/m.gguf"],
        2,
        "is 4-bit groups of 128, not 4-bit blocks of 32",
    ),
    (
        "export gguf: unknown --requantize",
        ["export", "{art}", "--format", "gguf", "--out", "{root}/m.gguf", "--requantize", "q5_0"],
        2,
        "'q5_0' is not one of 'q8_0', 'q4_0'",
    ),
    (
        "export gguf of int8 layers",
        ["export", "{int8}", "--format", "gguf", "--out", "{root}/m.gguf"],
        2,
        "qc.int8_linear: GGUF holds weight-only block quantization",
    ),
    ("report over user files", ["report", "{art}", "--out", "{victim}"], 2, "precious.txt"),
    # artifacts
    ("inspect: not an artifact", ["inspect", "{victim}"], 2, "not a qcompiler artifact"),
    ("inspect: missing folder", ["inspect", "{root}/nothing"], 2, "does not exist"),
    (
        "artifact: manifest not JSON",
        ["export", "{badjson}", "--format", "gptq", "--out", "{root}/o"],
        2,
        "not valid JSON",
    ),
    ("artifact: corrupted tensor", ["export", "{corrupt}", "--format", "gptq", "--out", "{root}/o"], 2, "SHA-256"),
    ("artifact: truncated tensors", ["export", "{truncated}", "--format", "gptq", "--out", "{root}/o"], 2, "SHA-256"),
    ("artifact: path traversal", ["export", "{traversal}", "--format", "gptq", "--out", "{root}/o"], 2, "plain name"),
    ("artifact: future version", ["export", "{version}", "--format", "gptq", "--out", "{root}/o"], 2, "not supported"),
    (
        "artifact: code injection",
        ["export", "{payload}", "--format", "gptq", "--out", "{root}/o"],
        2,
        "refusing the pytree spec",
    ),
    ("export: int8 as GPTQ", ["export", "{int8}", "--format", "gptq", "--out", "{root}/o"], 2, "weight-only"),
    (
        "export: --requantize for gptq does nothing",
        ["export", "{art}", "--format", "gptq", "--requantize", "q4_0", "--out", "{root}/o"],
        2,
        "--requantize applies to --format gguf, not gptq: it would do nothing",
    ),
    (
        "export: --token-embedding for onnx does nothing",
        ["export", "{art}", "--format", "onnx", "--token-embedding", "q8_0", "--out", "{root}/m.onnx"],
        2,
        "--token-embedding applies to --format gguf, not onnx: it would do nothing",
    ),
    (
        "export: --accuracy-level for gguf does nothing",
        ["export", "{art}", "--format", "gguf", "--accuracy-level", "0", "--out", "{root}/m.gguf"],
        2,
        "--accuracy-level applies to --format onnx / onnx-genai, not gguf",
    ),
    (
        "export: bad zero format",
        ["export", "{art}", "--format", "gptq", "--zero-format", "v3", "--out", "{root}/o"],
        2,
        "'v3' is not one of 'auto', 'v1', 'v2'",
    ),
    ("eval: artifact without source", ["eval", "{art}"], 2, "does not record its source"),
]


def _tree_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file() and not path.is_symlink():
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.mark.parametrize("case,argv,code,words", CLI_ROWS, ids=[r[0] for r in CLI_ROWS])
def test_cli_catalogue(case, argv, code, words, inputs, capsys, monkeypatch, tmp_path):
    cwd = tmp_path / "work" / "here"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(tmp_path / "work"))
    names = {k: str(v) for k, v in inputs.items()}
    names |= {"cwd": str(cwd), "home": str(tmp_path / "work"), "home_parent": str(tmp_path)}
    args = [a.format(**names) for a in argv]
    before = _tree_hash(inputs["root"]), _tree_hash(tmp_path)
    assert main(args) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and words in err[-1], err
    assert not any("Traceback" in line for line in err)
    assert (_tree_hash(inputs["root"]), _tree_hash(tmp_path)) == before, "something changed on disk"
    assert not (inputs["root"] / "PWNED").exists()


def test_no_arguments_prints_help_and_exits_0(capsys):
    assert main([]) == 0
    assert "quantize" in capsys.readouterr().out


@pytest.fixture(scope="module")
def compiled():
    return qc.compile(make_model("llama"), example_inputs("llama"), recipe="rtn-w4g128", progress=False)


def _ids(*shape, low=0, high=96, dtype=torch.long):
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def _nan_model():
    model = make_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    return model


def _nan_norm_model(value=float("nan")):
    model = make_model("llama")
    with torch.no_grad():
        model.model.layers[0].post_attention_layernorm.weight[7] = value
    return model


API_ROWS = [
    (
        "NaN weight with RTN",
        lambda cm: qc.compile(_nan_model(), example_inputs("llama"), recipe="rtn-w4g128", progress=False),
        qc.PassError,
        "layer model.layers.1.mlp.up_proj: 1 of its 8192 weights are NaN or Inf",
    ),
    (
        "NaN weight with SpQR",
        lambda cm: qc.compile(
            _nan_model(),
            example_inputs("llama"),
            recipe="spqr-w3g16",
            calibration=[example_inputs("llama")],
            progress=False,
        ),
        qc.PassError,
        "NaN or Inf",
    ),
    (
        "NaN weight with W8A8",
        lambda cm: qc.compile(
            _nan_model(), example_inputs("llama"), recipe="w8a8", calibration=[example_inputs("llama")], progress=False
        ),
        qc.QuantizationError,
        "NaN or Inf",
    ),
    (
        "NaN norm weight, no calibration",
        lambda cm: qc.compile(_nan_norm_model(), example_inputs("llama"), recipe="rtn-w4g128", progress=False),
        qc.QuantizationError,
        "model.layers.0.post_attention_layernorm.weight: 1 of its 64 values are NaN or Inf",
    ),
    (
        "Inf weight, FP graph",
        lambda cm: qc.compile(_nan_norm_model(float("inf")), example_inputs("llama"), recipe="none", progress=False),
        qc.QuantizationError,
        "post_attention_layernorm.weight: 1 of its 64",
    ),
    ("token id -1", lambda cm: cm(input_ids=_ids(1, 4) - 1 - _ids(1, 4).max()), ValueError, "token id -"),
    ("token id >= vocab", lambda cm: cm(input_ids=_ids(1, 4) + 96), ValueError, "outside the model's vocabulary"),
    ("float token ids", lambda cm: cm(input_ids=_ids(1, 4, dtype=torch.float32)), ValueError, "integer token ids"),
    (
        "attention mask value 2",
        lambda cm: cm(input_ids=_ids(1, 4), attention_mask=torch.tensor([[1, 1, 2, 1]])),
        ValueError,
        "attention_mask holds 2 at (0, 2); it must be 0 (padding) or 1 (a token)",
    ),
    (
        "encoder attention mask value 0.5",
        lambda cm: qc.compile(make_model("bert"), example_inputs("bert"), recipe="none", progress=False)(
            input_ids=_ids(1, 4), attention_mask=torch.tensor([[1.0, 0.5, 1.0, 1.0]])
        ),
        ValueError,
        "attention_mask holds 0.5 at (0, 1); it must be 0 (padding) or 1 (a token)",
    ),
    ("empty sequence", lambda cm: cm(input_ids=_ids(1, 0)), ValueError, "is empty"),
    (
        "unknown recipe",
        lambda cm: qc.compile(make_model("llama"), example_inputs("llama"), recipe="gptq-w9"),
        RecipeError,
        "gptq-w9",
    ),
    (
        "empty calibration",
        lambda cm: qc.compile(
            make_model("llama"), example_inputs("llama"), recipe="gptq-w4g128", calibration=[], progress=False
        ),
        CalibrationError,
        "empty",
    ),
    (
        "example of the wrong type",
        lambda cm: qc.compile(make_model("llama"), "text", recipe="none"),
        CaptureError,
        "example_inputs must be",
    ),
    ("load a missing artifact", lambda cm: qc.load("/nonexistent/artifact"), ArtifactError, "does not exist"),
    ("save over the cwd", lambda cm: cm.save(Path.cwd(), overwrite=True), OutputPathError, "current folder"),
    ("ONNX export to a folder", lambda cm: cm.export_onnx(Path.cwd()), OutputPathError, "is a folder"),
    (
        "unknown backend",
        lambda cm: qc.compile(make_model("llama"), example_inputs("llama"), recipe="none", backend="tpu"),
        BackendError,
        "tpu",
    ),
]


def test_weight_check_counts_non_finite_and_accepts_large_finite_weights():
    """The check reads the weights' float32 sum first: an overflowing sum of finite weights is not an error."""
    from qcompiler.pipeline.block_walk import _check_finite

    huge = torch.full((4, 8), 3e38)
    assert not torch.isfinite(huge.sum())
    _check_finite("big", huge)
    huge[1, 2], huge[3, 0] = float("nan"), float("-inf")
    with pytest.raises(qc.QuantizationError, match="layer big: 2 of its 32 weights are NaN or Inf"):
        _check_finite("big", huge)


@pytest.mark.parametrize("case,call,error,words", API_ROWS, ids=[r[0] for r in API_ROWS])
def test_api_catalogue(case, call, error, words, compiled, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error) as info:
        call(compiled)
    assert words in str(info.value) and "\n" not in str(info.value).strip()
    assert list(tmp_path.iterdir()) == []


def test_the_reliability_page_lists_every_case():
    page = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
    for case in [r[0] for r in CLI_ROWS] + [r[0] for r in API_ROWS]:
        assert f"| {case} |" in page, f"docs/reliability.md does not list {case!r}"


def test_a_recipe_file_that_is_not_a_regular_file_is_named_as_such(tmp_path):
    """A device, a FIFO or a folder given as --recipe is one line saying what it is, never opened (a
    FIFO would block the reader, /dev/zero never end); a link to a real recipe still reads."""
    import os

    from qcompiler.pipeline.recipe_files import MAX_RECIPE_BYTES, resolve_recipe

    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "folder.yaml").mkdir()
    (tmp_path / "big.yaml").write_text("#" * (MAX_RECIPE_BYTES + 1))
    for name, kind in (("zero", "character device"), ("fifo", "FIFO"), ("folder", "folder")):
        with pytest.raises(
            qc.RecipeError, match=rf"recipe file \S+/{name}\.yaml is not a regular file \(it is a {kind}\)"
        ):
            resolve_recipe(str(tmp_path / f"{name}.yaml"))
    with pytest.raises(
        qc.RecipeError, match=rf"big\.yaml is larger than recipes are limited to \({MAX_RECIPE_BYTES} bytes\)"
    ):
        resolve_recipe(str(tmp_path / "big.yaml"))
    (tmp_path / "real.yaml").write_text("name: mine\npasses:\n  - pass: RTN\n    bits: 4\n")
    (tmp_path / "link.yaml").symlink_to(tmp_path / "real.yaml")
    assert resolve_recipe(str(tmp_path / "link.yaml")).passes[0].bits == 4


def test_a_huge_or_special_tokenizer_file_is_refused_before_transformers_reads_it(tmp_path, capsys):
    """A 512 MiB tokenizer.json (sparse: nothing written) or a FIFO in its place: one line naming the file,
    nothing read (transformers would read it whole, or block). Outside the catalogue: its rows hash
    every prepared input before and after, and this one is half a gigabyte."""
    import os

    model = tmp_path / "model"
    make_model("llama").save_pretrained(model)
    with open(model / "tokenizer.json", "wb") as f:
        f.truncate(512 << 20)
    assert main(["quantize", str(model), "--recipe", "rtn-w4g128", "--out", str(tmp_path / "o")]) == 2
    assert "tokenizer.json is 536870912 bytes, over the 256 MiB a tokenizer file may have" in capsys.readouterr().err
    (model / "tokenizer.json").unlink()
    os.mkfifo(model / "tokenizer.json")
    assert main(["quantize", str(model), "--recipe", "rtn-w4g128", "--out", str(tmp_path / "o")]) == 2
    assert "tokenizer.json is not a regular file (it is a FIFO)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
