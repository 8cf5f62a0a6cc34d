"""Artifacts are untrusted data: tampered files fail with a clear error and never run code.

Each attack rewrites the file *and* its checksum in the manifest (an attacker can do both), so
what stops it is the loader's validation, not the checksum. Every payload tries to create a
marker file; the tests assert it never appears, at load or at the first call.
"""

import hashlib
import json
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import example_inputs, main_output, make_model

import qcompiler as qc
from qcompiler.store.graph_format import _OPERATORS, ArtifactError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = make_model("llama")
    cm = qc.compile(model, example_inputs("llama"), recipe="rtn-w4g128", progress=False)
    path = tmp_path_factory.mktemp("safety") / "art"
    cm.save(path)
    return path


def _copy(saved, tmp_path):
    target = tmp_path / "art"
    shutil.copytree(saved, target)
    return target


def _resign(path):
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["sha256"] = {
        name: hashlib.sha256((path / name).read_bytes()).hexdigest()
        for name in manifest["files"].values()
        if (path / name).is_file()
    }
    (path / "manifest.json").write_text(json.dumps(manifest))


def _tamper_graph(path, mutate):
    graph = json.loads((path / "graph.json").read_text())
    mutate(graph)
    (path / "graph.json").write_text(json.dumps(graph))
    _resign(path)


def _payload(marker):
    return f"__import__('pathlib').Path({str(marker)!r}).touch()"


def _load_and_call(path):
    cm = qc.load(path)
    cm(**example_inputs("llama", batch=1, seq=4))
    return cm


def _first(graph, op):
    return next(n for n in graph["nodes"] if n["op"] == op)


ROUTES = {
    # an extra entry in the pytree spec's argument list lands in the generated signature
    "pytree orig_args": lambda g, p: g["pytree"]["orig_args"].append(f"x={p}"),
    # a placeholder target is a parameter name of the generated forward()
    "placeholder target": lambda g, p: _first(g, "placeholder").update(target=f"input_ids={p}"),
    # a keyword-argument name is written as `name=value` into a call
    "kwarg name": lambda g, p: _first(g, "call_function")["kwargs"].update({f"x=({p}) or 1, y": 1}),
    # allow-listed operator functions that reach attributes: attrgetter -> __globals__ -> exec
    "operator.attrgetter": lambda g, p: _first(g, "call_function").update(target="operator.attrgetter"),
    "operator.methodcaller": lambda g, p: _first(g, "call_function").update(target="operator.methodcaller"),
    # a tensor name becomes getattr(self, "<part>") in source when a part is not an identifier
    "get_attr target": lambda g, p: (
        _first(g, "get_attr").update(target=f'w"); {p}; ("'),
        g["tensor_kinds"].update({f'w"); {p}; ("': "parameter"}),
    ),
    "node name": lambda g, p: _first(g, "call_function").update(name=f"x = {p}; y"),
    # keys of the input spec's dict are quoted into the generated source
    "in_spec key": lambda g, p: g["pytree"].update(
        in_spec=g["pytree"]["in_spec"].replace('\\"use_cache\\"', json.dumps(json.dumps(f"u'+{p}+'"))[2:-2])
    ),
    "output type import": lambda g, p: g["pytree"].update(
        out_spec=g["pytree"]["out_spec"].replace("transformers.modeling_outputs", "os.path")
    ),
    "foreign call target": lambda g, p: _first(g, "call_function").update(target="os.system"),
    "file-system aten op": lambda g, p: _first(g, "call_function").update(target="torch.ops.aten.from_file.default"),
}


def test_the_untampered_copy_loads_and_runs(saved, tmp_path):
    """The control for every attack below: only the tampering makes loading fail. The rewritten,
    re-signed copy computes the saved model's logits bit for bit (so the rewriting itself, which
    every attack goes through, changes nothing by accident)."""
    path = _copy(saved, tmp_path)
    _tamper_graph(path, lambda g: None)  # rewritten and re-signed, unchanged
    inputs = example_inputs("llama", batch=1, seq=4)
    with torch.no_grad():
        assert torch.equal(_load_and_call(path)(**inputs).logits, qc.load(saved)(**inputs).logits)


def test_a_loaded_model_does_not_depend_on_its_files(saved, tmp_path):
    """Tensors are read from a mapping of the file but copied: truncating or deleting the files
    after loading (a user rewriting the folder by hand) must not crash or change the model."""
    path = _copy(saved, tmp_path)
    cm = qc.load(path)
    inputs = example_inputs("llama", batch=1, seq=4)
    before = cm(**inputs).logits.clone()
    for f in path.glob("*.safetensors"):
        with open(f, "r+b") as handle:
            handle.truncate(0)
    assert torch.equal(cm(**inputs).logits, before)


@pytest.mark.parametrize("route", list(ROUTES))
def test_code_execution_routes_are_refused(route, saved, tmp_path):
    path, marker = _copy(saved, tmp_path), tmp_path / "PWNED"
    _tamper_graph(path, lambda g: ROUTES[route](g, _payload(marker)))
    with pytest.raises(ArtifactError) as info:
        _load_and_call(path)
    assert not marker.exists(), f"{route}: the payload ran"
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_manifest_file_names_stay_inside_the_artifact(saved, tmp_path):
    path = _copy(saved, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["graph"] = "../../etc/passwd"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="not a plain name inside the artifact"):
        qc.load(path)


def test_a_corrupted_tensor_is_detected_by_its_checksum(saved, tmp_path):
    path = _copy(saved, tmp_path)
    data = bytearray((path / "tensors.safetensors").read_bytes())
    data[-3] ^= 0x40  # still a valid safetensors file, one weight changed
    (path / "tensors.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="tensors.safetensors does not match its SHA-256"):
        qc.load(path)


def _string_slots(value, path=()):
    """(path, is_key) of every string value and dict key in a JSON document."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield path + (k,), True
            yield from _string_slots(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _string_slots(v, path + (i,))
    elif isinstance(value, str):
        yield path, False


def _replace(doc, path, is_key, text):
    *parents, last = path
    holder = doc
    for p in parents:
        holder = holder[p]
    if is_key:
        holder[text] = holder.pop(last)
    else:
        holder[last] = text


ALLOWED_TARGETS = set(_OPERATORS.values())


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzzed_graph_files_fail_cleanly_or_load_only_allowed_targets(data, saved, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    path, marker = _copy(saved, tmp), tmp / "PWNED"
    graph = json.loads((saved / "graph.json").read_text())
    slots = list(_string_slots(graph))
    for _ in range(data.draw(st.integers(1, 3))):
        slot, is_key = data.draw(st.sampled_from(slots))
        text = data.draw(
            st.sampled_from(
                [
                    _payload(marker),
                    f"x={_payload(marker)}",
                    f'a"); {_payload(marker)}; ("',
                    f"'+{_payload(marker)}+'",
                    "operator.attrgetter",
                    "operator.call",
                    "builtins.exec",
                    "torch.ops.aten.from_file.default",
                    "",
                    "0",
                    "__class__",
                    "a.b..c",
                    "../x",
                ]
            )
            | st.text(max_size=12)
        )
        try:
            _replace(graph, slot, is_key, text)
        except (KeyError, TypeError):
            continue
    (path / "graph.json").write_text(json.dumps(graph))
    _resign(path)
    try:
        cm = qc.load(path)
    except ArtifactError:
        assert not marker.exists()
        return
    for node in cm.graph_module.graph.nodes:
        if node.op == "call_function":
            assert isinstance(node.target, torch._ops.OpOverload) or node.target in ALLOWED_TARGETS, node.target
        assert node.op in ("placeholder", "get_attr", "call_function", "output")
    try:
        main_output(cm(**example_inputs("llama", batch=1, seq=4)))
    except Exception:  # a mutated but well-formed graph may fail to run: it must not run code
        pass
    assert not marker.exists()


@pytest.mark.parametrize("file", ["graph.json", "manifest.json", "tensors.safetensors"])
@pytest.mark.parametrize("kind", ["link to /dev/zero", "fifo", "link to a file outside"])
def test_special_files_fail_fast_with_one_line(file, kind, saved, tmp_path):
    """A link or a FIFO in place of an artifact file would hang a reader or exhaust its memory."""
    path = _copy(saved, tmp_path)
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (path / file).unlink()
    if kind == "fifo":
        os.mkfifo(path / file)
    else:
        (path / file).symlink_to("/dev/zero" if "zero" in kind else outside)
    with pytest.raises(ArtifactError) as info:
        qc.load(path)
    message = str(info.value)
    assert file in message and "\n" not in message
    # refused by what the file is (no link followed, no FIFO read), not after reading from it
    assert ("not a regular file" if kind == "fifo" else "symbolic links") in message


def test_an_oversized_manifest_is_refused_before_it_is_read(saved, tmp_path, monkeypatch):
    import qcompiler.store.artifact as artifact

    path = _copy(saved, tmp_path)
    monkeypatch.setattr(artifact, "_MAX_JSON_BYTES", 1000)
    with pytest.raises(ArtifactError, match=r"manifest.json.*over the 1000-byte bound"):
        qc.load(path)


def test_exports_never_follow_a_path_from_the_manifest(tmp_path):
    """The tokenizer files travel inside the artifact (checksummed); a tampered ``source_path``
    pointing at another folder copies nothing from it."""
    from qcompiler.interop import export_compressed_tensors

    model_dir, secret = tmp_path / "model", tmp_path / "secret"
    make_model("llama").save_pretrained(model_dir)
    (model_dir / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    secret.mkdir()
    (secret / "tokenizer.json").write_text('{"secret": "ssh key"}')
    cm = qc.load(_save_compiled(model_dir, tmp_path / "art"))
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["files"]["model_files"] == ["generation_config.json", "tokenizer_config.json"]
    manifest["capture"]["source_path"] = str(secret)
    (tmp_path / "art" / "manifest.json").write_text(json.dumps(manifest))
    cm = qc.load(tmp_path / "art")
    export_compressed_tensors(cm, tmp_path / "ct", progress=lambda _: None)
    assert (tmp_path / "ct" / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    assert not (tmp_path / "ct" / "tokenizer.json").exists()
    (tmp_path / "art" / "tokenizer_config.json").write_text('{"model_max_length": 1}')
    with pytest.raises(ArtifactError, match="tokenizer_config.json does not match its SHA-256"):
        qc.load(tmp_path / "art")


def _save_compiled(model_dir, out):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config._name_or_path = str(model_dir)
    cm = qc.compile(model, example_inputs("llama"), recipe="rtn-w4g128", progress=False)
    assert cm.capture_info.source_path == str(model_dir)
    cm.save(out)
    return out


@pytest.mark.parametrize(
    "op,args,ok",
    [("pow", (2, 10), 1024), ("pow", (7, 10**12), None), ("lshift", (1, 10**9), None), ("lshift", (3, 4), 48)]
    + [("mul", ([0], 10**12), None), ("mul", (6, 7), 42), ("mul", (10**30, 10**30), 10**60)]
    + [("mul", (2**600, 2**600), None), ("pow", (10.0, 400.0), None)],
)
def test_stored_arithmetic_is_bounded(op, args, ok):
    """A loaded graph's allow-listed ``operator`` calls refuse runaway results at once (a chain of
    60 self-multiplications from 10**18 stops at its first product past 1024 bits)."""
    from qcompiler.store.graph_format import GraphEvaluationError, _resolve_target

    fn = _resolve_target(f"operator.{op}")
    if ok is None:  # refused by the size of the operands, before any arithmetic
        with pytest.raises(GraphEvaluationError, match="repeats|exceeds|overflows"):
            fn(*args)
    else:
        assert fn(*args) == ok


def test_a_graph_with_bounded_arithmetic_round_trips():
    """The bounded operators are what a loaded graph calls, and such a graph saves again."""
    import operator

    from torch import fx

    from qcompiler.store.graph_format import graph_from_data, graph_to_data

    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(operator.mul, (x, 3)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    structure, tensors = graph_to_data(gm)
    loaded = graph_from_data(json.loads(json.dumps(structure)), tensors)
    assert loaded(torch.ones(2)).tolist() == [3.0, 3.0]
    assert graph_to_data(loaded)[0]["nodes"] == structure["nodes"]


def test_a_chain_of_self_multiplications_stops_at_the_bound():
    from qcompiler.store.graph_format import GraphEvaluationError, _resolve_target

    mul, x, steps = _resolve_target("operator.mul"), 10**18, 0
    with pytest.raises(GraphEvaluationError, match="exceeds 1024 bits"):
        while steps < 60:
            x, steps = mul(x, x), steps + 1
    assert steps < 6 and x.bit_length() <= 1024


HOSTILE = [
    "<script>alert(1)</script>",
    '<img src=x onerror="alert(1)">',
    "<iframe src=//evil></iframe>",
    "[click](javascript:alert(1))",
    "\x1b[2J\x1b]52;c;ZXZpbA==\x07",
    "a|b`c` **x** ![i](http://evil/p.png)",
    r"$\frac{1}{$ math $x^{$",  # mathtext in a plot label
]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_report_and_inspect_escape_every_string_from_the_manifest(hostile, saved, tmp_path, capsys):
    """The manifest carries no checksum: a one-line edit of a downloaded artifact must not put HTML,
    links, markdown layout or terminal escapes into report.md or the terminal."""
    from qcompiler.cli import main

    path = _copy(saved, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["capture"]["model_class"] = hostile
    manifest["metadata"]["source"] = hostile
    manifest["recipe"]["name"] = manifest["recipe"]["description"] = hostile
    record = manifest["report"]["passes"][0]
    record["notes"] = [hostile]
    record["layers"] = {hostile: {"rel_error": 0.5, "bits": 4}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert main(["report", str(path), "--out", str(tmp_path / "r")]) == 0
    page = (tmp_path / "r" / "report.md").read_text()
    assert main(["inspect", str(path)]) == 0
    shown = capsys.readouterr().out
    for text in (page, shown):
        assert "\x1b" not in text and "\x07" not in text
    for raw in ("<script", "<img", "<iframe", "](javascript:", "](http://evil"):
        assert raw not in page, raw
    assert page.count("<code>") == page.count("</code>")  # no code span closed early by the name


def test_a_graph_without_its_output_node_is_refused(saved, tmp_path):
    """It would load and return None from every call."""
    path = _copy(saved, tmp_path)
    _tamper_graph(path, lambda g: g.__setitem__("nodes", [n for n in g["nodes"] if n["op"] != "output"]))
    with pytest.raises(ArtifactError, match="the graph has 0 output nodes; a graph ends in exactly one"):
        qc.load(path)


def test_json_nested_past_any_artifact_is_refused_not_a_recursion_error(saved, tmp_path):
    path = _copy(saved, tmp_path)
    (path / "graph.json").write_text("[" * 100_000 + "]" * 100_000)
    _resign(path)
    with pytest.raises(ArtifactError, match=r"graph\.json nests deeper than any artifact does"):
        qc.load(path)


def _edit_safetensors_header(path, edit):
    """Rewrite the header of ``path``'s tensors file with ``edit(header)`` (the data bytes unchanged)."""
    f = path / "tensors.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    f.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    _resign(path)


@pytest.mark.parametrize(
    "edit,message",
    [
        # the same bytes read as float32 codes
        (
            lambda h: h["model.layers.0.self_attn.q_proj.qweight"].update(dtype="F32"),
            r"layer model\.layers\.0\.self_attn\.q_proj\): qweight is float32, qc\.quant_linear stores int32",
        ),
        # scales [groups, out] read as [out, groups]
        (
            lambda h: h["model.layers.1.mlp.down_proj.scales"].update(
                shape=h["model.layers.1.mlp.down_proj.scales"]["shape"][::-1]
            ),
            r"layer model\.layers\.1\.mlp\.down_proj\): qweight has shape \(\d+, 64\), qc\.quant_linear here needs",
        ),
    ],
    ids=["relabelled-dtype", "transposed-scales"],
)
def test_a_relabelled_or_reshaped_stored_tensor_is_named_at_load(edit, message, saved, tmp_path):
    """A re-signed artifact whose tensors file says another dtype or shape for a layer's stored tensor
    is refused at load in one line naming the file, the node, the layer and the tensor — not an
    index error from inside the op when it first runs."""
    path = _copy(saved, tmp_path)
    _edit_safetensors_header(path, edit)
    with pytest.raises(ArtifactError, match=message):
        qc.load(path)


def test_a_changed_block_type_is_named_at_load_not_at_export(tmp_path):
    """A re-signed graph.json whose llama.cpp block type reads 'Q9_K' (it used to surface as
    ``KeyError 'Q9_K'`` at GGUF export) is refused at load, naming the node and layer."""
    cm = qc.compile(make_model("llama"), example_inputs("llama"), recipe="rtn-q4_1", progress=False)
    cm.save(tmp_path / "art")

    def retype(graph):
        node = next(n for n in graph["nodes"] if "gguf_linear" in str(n["target"]))
        node["args"]["tuple"] = [("Q9_K" if a == "Q4_1" else a) for a in node["args"]["tuple"]]

    _tamper_graph(tmp_path / "art", retype)
    with pytest.raises(
        ArtifactError, match=r"layer model\.layers\.0\.\S+\): block_type 'Q9_K' is not one qc\.gguf_linear holds"
    ):
        qc.load(tmp_path / "art")


def _retensor(path, edit):
    """Rewrite stored tensors' values (``edit(tensors)`` in place) and re-sign."""
    from safetensors.torch import load_file, save_file

    f = path / "tensors.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))
    _resign(path)


@pytest.fixture(scope="module")
def saved_spqr_rotated(tmp_path_factory):
    """SpQR on a rotated graph: dense + CSR outlier branches and online Hadamard rotations."""
    model = make_model("llama")
    recipe = [qc.passes.Rotate(), qc.passes.SpQR(outlier_threshold=0.2)]
    calibration = [example_inputs("llama", batch=4, seq=16)]
    cm = qc.compile(model, example_inputs("llama"), recipe=recipe, calibration=calibration, progress=False)
    path = tmp_path_factory.mktemp("spqr") / "art"
    cm.save(path)
    return path


def _first_named(tensors, suffix):
    return next(k for k in sorted(tensors) if k.endswith(suffix))


def _past_the_values(t):  # the last row pointer beyond the stored outliers: a kernel would read past them
    key = _first_named(t, ".row_ptr")
    t[key] = t[key].clone()
    t[key][-1] += 7


def _unsorted_row_ptr(t):
    key = _first_named(t, ".row_ptr")
    t[key] = t[key].clone()
    t[key][1] = t[key][-1] + 1


def _repeated_column(t):  # perm names one input column twice
    key = _first_named(t, ".perm")
    t[key] = t[key].clone()
    t[key][1] = t[key][0]


def _wide_signs(t):  # signs that are not ±1
    key = _first_named(t, "_signs")
    t[key] = t[key].clone()
    t[key][0] = 3


@pytest.mark.parametrize(
    "edit,message",
    [
        (_past_the_values, r"row_ptr does not run non-decreasing from 0 to the \d+ stored outliers"),
        (_unsorted_row_ptr, r"row_ptr does not run non-decreasing"),
        (_repeated_column, r"perm is not a permutation of the \d+ input columns"),
        (_wide_signs, r"signs holds values other than \+1 and -1"),
    ],
    ids=["row-pointer-past-the-values", "row-pointers-out-of-order", "perm-not-a-permutation", "signs-not-unit"],
)
def test_tampered_spqr_and_rotation_tensors_are_named_at_load(edit, message, saved_spqr_rotated, tmp_path):
    """SpQR's CSR outliers, its permutation and an online rotation's signs are checked when an artifact
    loads (a row pointer past the stored values would read outside them in the CSR kernel): one line
    naming the node and the problem, before anything runs. The control: the untouched copy loads."""
    qc.load(_copy(saved_spqr_rotated, tmp_path / "control"))
    path = _copy(saved_spqr_rotated, tmp_path)
    _retensor(path, edit)
    with pytest.raises(ArtifactError, match=message):
        qc.load(path)


def test_a_hadamard_block_no_model_has_is_refused_before_it_is_built(saved_spqr_rotated, tmp_path):
    """A block size of 2^20 would build a 2^20 x 2^20 matrix at the first call: refused at load."""
    path = _copy(saved_spqr_rotated, tmp_path)

    def widen(graph):
        node = next(n for n in graph["nodes"] if n["op"] == "call_function" and "hadamard" in str(n["target"]))
        node["args"]["tuple"] = [
            a if not isinstance(a, int) or isinstance(a, bool) else 2**20 for a in node["args"]["tuple"]
        ]

    _tamper_graph(path, widen)
    with pytest.raises(ArtifactError, match=r"block_size 1048576 is not a power of two up to 16384"):
        qc.load(path)


def _set_node_args(name: str, args: dict):
    def mutate(graph):
        next(n for n in graph["nodes"] if n["name"] == name)["args"] = args

    return mutate


@pytest.mark.parametrize(
    "node,args",
    [
        ("expand", {"tuple": [{"node": "unsqueeze"}, {"list": [100_000, 100_000, 100_000]}]}),
        ("arange", {"tuple": [10**12]}),
    ],
    ids=["expand", "arange"],
)
def test_a_literal_size_past_what_the_tensors_could_need_is_refused_at_load(saved, tmp_path, node, args):
    """A re-signed graph asking an allow-listed op for 10^15 or 10^12 elements is one line naming the
    node at load, before any allocation (it used to end in the allocator's error at the first call)."""
    path = _copy(saved, tmp_path)
    _tamper_graph(path, _set_node_args(node, args))
    with pytest.raises(ArtifactError, match=rf"graph node {node} asks for \d+ elements, more than this artifact"):
        qc.load(path)


def test_the_size_bound_scales_with_the_stored_tensors():
    """2^30 elements at least; 16x the largest stored tensor above that (an expanded view: no memory)."""
    from qcompiler.store.graph_sizes import size_bound

    assert size_bound({"w": torch.empty(2, 3)}) == 1 << 30
    assert size_bound({"w": torch.empty(1).expand(1 << 28), "b": torch.empty(3)}) == 16 << 28
