"""One decode step of one attention layer in ONNX Runtime: plain ONNX ops vs the GroupQueryAttention
contrib op, with rotary inside and as qcompiler emits it, side by side (outputs checked equal first).

    python benchmarks/attention_ops.py            # the 0.44 B LLaMA's layer shape, contexts 128 / 512 / 1024
    python benchmarks/attention_ops.py --quick

Why: the generation issue asks to use ``GroupQueryAttention`` where it is faster on CPU than plain
ops. The plain graph here is the per-layer attention our export wrote before it did: rotary
(rotate-half) on q and k, past/present concatenation, the KV heads repeated to the query heads,
softmax(q kᵀ · scale + mask) v. "GQA with rotary" does all of it in one node (rotary from cos/sin
caches, as onnxruntime-genai's model builder emits it); "GQA as emitted" is what
backends/onnx_attention.py writes: rotary still as plain ops (so every rotary variant of
transformers stays exact), then one node with the model's mask as ``attention_bias``.
Times are the median of --calls calls after warm-up, one thread; the table also scales the
per-layer saving to the 32-layer model and compares it to the measured per-token decode time in
benchmarks/results/generate.json. Writes benchmarks/results/attention_ops.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import write_atomically  # noqa: E402
from results_file import RESULTS_DIR, results_file  # noqa: E402

SHAPE = dict(heads=8, kv_heads=4, head_dim=128, layers=32, max_len=2048)  # benchmarks/generate.py's llama_05b


def _inputs(heads: int, kv_heads: int, d: int, max_len: int, extra: list) -> list:
    f = TensorProto.FLOAT
    return [
        helper.make_tensor_value_info("q", f, [1, 1, heads * d]),
        helper.make_tensor_value_info("k", f, [1, 1, kv_heads * d]),
        helper.make_tensor_value_info("v", f, [1, 1, kv_heads * d]),
        helper.make_tensor_value_info("past_k", f, [1, kv_heads, "P", d]),
        helper.make_tensor_value_info("past_v", f, [1, kv_heads, "P", d]),
        *extra,
    ]


def _outputs(heads: int, kv_heads: int, d: int) -> list:
    f = TensorProto.FLOAT
    return [
        helper.make_tensor_value_info("out", f, [1, 1, heads * d]),
        helper.make_tensor_value_info("present_k", f, [1, kv_heads, "T", d]),
        helper.make_tensor_value_info("present_v", f, [1, kv_heads, "T", d]),
    ]


def _prelude(heads: int, kv_heads: int, d: int) -> tuple[list, list, callable]:
    """Shared constants and the q/k/v reshaping + rotate-half rotary that both our graphs run as
    plain ops: ``qr`` [1, heads, 1, d], ``kr`` / ``vh`` [1, kv_heads, 1, d]."""
    f = TensorProto.FLOAT
    half, group = d // 2, heads // kv_heads
    c = lambda name, values: helper.make_tensor(name, TensorProto.INT64, [len(values)], values)  # noqa: E731
    inits = [
        c("q_shape", [1, 1, heads, d]),
        c("kv_shape", [1, 1, kv_heads, d]),
        c("out_shape", [1, 1, heads * d]),
        c("zero", [0]),
        c("half", [half]),
        c("end", [d]),
        c("last", [3]),
        c("rep_expand", [1, kv_heads, group, 1, 1]),
        c("kv_full", [1, heads, -1, d]),
        c("two", [2]),
        c("tokens_first", [0, 0, -1]),
        helper.make_tensor("scale", f, [], [1.0 / d**0.5]),
    ]
    nodes = []

    def heads_first(x, shape, name):
        nodes.append(helper.make_node("Reshape", [x, shape], [f"{name}_r"]))
        nodes.append(helper.make_node("Transpose", [f"{name}_r"], [name], perm=[0, 2, 1, 3]))

    def rotary(x, name):  # x * cos + rotate_half(x) * sin
        nodes.extend(
            [
                helper.make_node("Slice", [x, "zero", "half", "last"], [f"{name}_a"]),
                helper.make_node("Slice", [x, "half", "end", "last"], [f"{name}_b"]),
                helper.make_node("Neg", [f"{name}_b"], [f"{name}_nb"]),
                helper.make_node("Concat", [f"{name}_nb", f"{name}_a"], [f"{name}_rot"], axis=3),
                helper.make_node("Mul", [x, "cos"], [f"{name}_xc"]),
                helper.make_node("Mul", [f"{name}_rot", "sin"], [f"{name}_rs"]),
                helper.make_node("Add", [f"{name}_xc", f"{name}_rs"], [name]),
            ]
        )

    heads_first("q", "q_shape", "qh")
    heads_first("k", "kv_shape", "kh")
    heads_first("v", "kv_shape", "vh")
    rotary("qh", "qr")
    rotary("kh", "kr")
    rows = [
        helper.make_tensor_value_info("cos", f, [1, 1, 1, d]),
        helper.make_tensor_value_info("sin", f, [1, 1, 1, d]),
        helper.make_tensor_value_info("mask", f, [1, 1, 1, "T"]),
    ]
    return inits, nodes, rows


def plain_graph(heads: int, kv_heads: int, d: int, max_len: int) -> onnx.ModelProto:
    """Attention as our export wrote it before GroupQueryAttention: rotary by rotate-half, Concat
    past/new, repeat KV, MatMul, Softmax, MatMul. ``cos``/``sin`` are the rows of the new position."""
    inits, nodes, extra = _prelude(heads, kv_heads, d)

    def repeat(x, name):  # [1, kv, T, d] -> [1, heads, T, d]
        nodes.extend(
            [
                helper.make_node("Unsqueeze", [x, "two"], [f"{name}_u"]),
                helper.make_node("Expand", [f"{name}_u", "rep_expand"], [f"{name}_e"]),
                helper.make_node("Reshape", [f"{name}_e", "kv_full"], [name]),
            ]
        )

    nodes.append(helper.make_node("Concat", ["past_k", "kr"], ["present_k"], axis=2))
    nodes.append(helper.make_node("Concat", ["past_v", "vh"], ["present_v"], axis=2))
    repeat("present_k", "k_all")
    repeat("present_v", "v_all")
    nodes.extend(
        [
            helper.make_node("Transpose", ["k_all"], ["k_t"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", ["qr", "k_t"], ["scores"]),
            helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
            helper.make_node("Add", ["scaled", "mask"], ["masked"]),
            helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
            helper.make_node("MatMul", ["probs", "v_all"], ["ctx"]),
            helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", ["ctx_t", "out_shape"], ["out"]),
        ]
    )
    graph = helper.make_graph(
        nodes, "plain", _inputs(heads, kv_heads, d, max_len, extra), _outputs(heads, kv_heads, d), inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def emitted_graph(heads: int, kv_heads: int, d: int, max_len: int) -> onnx.ModelProto:
    """What qcompiler's export emits now (backends/onnx_attention.py): the same rotary as plain ops,
    then one GroupQueryAttention node with the mask as ``attention_bias``, ``seqlens_k = T - 1`` and
    ``query_seqlens = S`` (here constant inputs; the export computes them from shapes)."""
    inits, nodes, extra = _prelude(heads, kv_heads, d)
    i32 = TensorProto.INT32
    for x in ("qr", "kr", "vh"):
        nodes.append(helper.make_node("Transpose", [x], [f"{x}_t"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Reshape", [f"{x}_t", "tokens_first"], [f"{x}_s"]))
    nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            [
                "qr_s",
                "kr_s",
                "vh_s",
                "past_k",
                "past_v",
                "seqlens_k",
                "total_len",
                "",
                "",
                "",
                "mask",
                "",
                "",
                "",
                "",
                "",
                "query_seqlens",
            ],
            ["out", "present_k", "present_v"],
            domain="com.microsoft",
            num_heads=heads,
            kv_num_heads=kv_heads,
            scale=1.0 / d**0.5,
        )
    )
    extra += [
        helper.make_tensor_value_info("seqlens_k", i32, [1]),
        helper.make_tensor_value_info("total_len", i32, []),
        helper.make_tensor_value_info("query_seqlens", i32, [1]),
    ]
    graph = helper.make_graph(
        nodes, "emitted", _inputs(heads, kv_heads, d, max_len, extra), _outputs(heads, kv_heads, d), inits
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )


def gqa_graph(heads: int, kv_heads: int, d: int, max_len: int) -> onnx.ModelProto:
    """The same step as one com.microsoft GroupQueryAttention node (rotary inside, from caches)."""
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total_len", "cos_cache", "sin_cache"],
        ["out", "present_k", "present_v"],
        domain="com.microsoft",
        num_heads=heads,
        kv_num_heads=kv_heads,
        do_rotary=1,
        rotary_interleaved=0,
        scale=1.0 / d**0.5,
    )
    extra = [
        helper.make_tensor_value_info("seqlens_k", i32, [1]),
        helper.make_tensor_value_info("total_len", i32, []),
        helper.make_tensor_value_info("cos_cache", f, [max_len, d // 2]),
        helper.make_tensor_value_info("sin_cache", f, [max_len, d // 2]),
    ]
    graph = helper.make_graph([node], "gqa", _inputs(heads, kv_heads, d, max_len, extra), _outputs(heads, kv_heads, d))
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )


def feeds(past: int, heads: int, kv_heads: int, d: int, max_len: int, seed: int = 0) -> tuple[dict, dict, dict]:
    """The same decode step for the three graphs: the new token at position ``past``."""
    rng = np.random.default_rng(seed)
    shared = {
        "q": rng.standard_normal((1, 1, heads * d), np.float32),
        "k": rng.standard_normal((1, 1, kv_heads * d), np.float32),
        "v": rng.standard_normal((1, 1, kv_heads * d), np.float32),
        "past_k": rng.standard_normal((1, kv_heads, past, d), np.float32),
        "past_v": rng.standard_normal((1, kv_heads, past, d), np.float32),
    }
    inv_freq = 1.0 / 10000 ** (np.arange(0, d, 2, dtype=np.float64) / d)
    angles = np.outer(np.arange(max_len), inv_freq)
    cos_cache, sin_cache = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    row = lambda cache: np.concatenate([cache[past], cache[past]]).reshape(1, 1, 1, d)  # noqa: E731
    plain = {**shared, "cos": row(cos_cache), "sin": row(sin_cache), "mask": np.zeros((1, 1, 1, past + 1), np.float32)}
    gqa = {
        **shared,
        "seqlens_k": np.array([past], np.int32),
        "total_len": np.array(past + 1, np.int32),
        "cos_cache": cos_cache,
        "sin_cache": sin_cache,
    }
    emitted = {
        **plain,
        "seqlens_k": gqa["seqlens_k"],
        "total_len": gqa["total_len"],
        "query_seqlens": np.array([1], np.int32),
    }
    return plain, gqa, emitted


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3  # the shared constants some graphs leave unused are no news
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def median_us(sess: ort.InferenceSession, feed: dict, calls: int) -> float:
    for _ in range(10):
        sess.run(None, feed)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def decode_ms_per_token() -> float | None:
    """The genai rtn-w4g128-head export's measured ms per token on the 0.44 B model, if recorded."""
    path = RESULTS_DIR / "generate.json"
    if not path.is_file():
        return None
    for row in json.loads(path.read_text()).get("rows", []):
        if row.get("model", "").startswith("llama") and row.get("engine", "").endswith("rtn-w4g128-head"):
            return 1000.0 / row["decode_tok_s"]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", type=Path, help="default: results/attention_ops.json (results/quick/ with --quick)")
    args = ap.parse_args()
    args.out = args.out or results_file("attention_ops", args.quick)
    s = SHAPE
    dims = (s["heads"], s["kv_heads"], s["head_dim"], s["max_len"])
    graphs = {"plain": plain_graph(*dims), "gqa": gqa_graph(*dims), "emitted": emitted_graph(*dims)}
    sessions = {name: session(g) for name, g in graphs.items()}
    rows = []
    for past in (128,) if args.quick else (128, 512, 1024):
        feed = dict(zip(graphs, feeds(past, *dims)))
        outs = {name: sessions[name].run(None, feed[name]) for name in graphs}
        gap = max(
            float(np.abs(x - y).max() / np.abs(x).max())
            for name in ("gqa", "emitted")
            for x, y in zip(outs["plain"], outs[name])
        )
        if gap > 1e-4:
            raise SystemExit(
                f"past {past}: GroupQueryAttention differs from the plain ops by {gap:.2e}: "
                f"the graphs do not compute the same step"
            )
        calls = 30 if args.quick else args.calls
        t = {name: median_us(sessions[name], feed[name], calls) for name in graphs}
        rows.append(
            {
                "past": past,
                "plain_us": round(t["plain"], 1),
                "gqa_us": round(t["gqa"], 1),
                "emitted_us": round(t["emitted"], 1),
                "ratio": round(t["gqa"] / t["plain"], 3),
                "emitted_ratio": round(t["emitted"] / t["plain"], 3),
                "max_rel_gap": gap,
                "saving_ms_per_token_32_layers": round((t["plain"] - t["emitted"]) * s["layers"] / 1000, 3),
            }
        )
    per_token = decode_ms_per_token()  # measured with 128-255 past tokens: only comparable at 128
    print(
        f"one attention layer, decode step, heads {s['heads']} / KV heads {s['kv_heads']} x {s['head_dim']}, 1 thread"
    )
    print(
        "| past tokens | plain ONNX ops, µs | GQA with rotary, µs | GQA as emitted, µs | emitted / plain | "
        "saved per token, 32 layers |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        share = (
            f" ({r['saving_ms_per_token_32_layers'] / per_token:.0%} of the genai export's {per_token:.1f} ms/token)"
            if per_token and r["past"] == 128
            else ""
        )
        print(
            f"| {r['past']} | {r['plain_us']} | {r['gqa_us']} | {r['emitted_us']} | {r['emitted_ratio']} | "
            f"{r['saving_ms_per_token_32_layers']} ms{share} |"
        )
    write_atomically(
        args.out,
        json.dumps(
            {"shape": s, "onnxruntime": ort.__version__, "rows": rows, "genai_ms_per_token_0.44B": per_token}, indent=2
        )
        + "\n",
    )


if __name__ == "__main__":
    main()
