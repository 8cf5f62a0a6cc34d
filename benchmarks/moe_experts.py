"""Quality of quantized mixture-of-experts layers: every expert matrix, RTN vs GPTQ vs SpQR.

    python benchmarks/moe_experts.py            # Mixtral and Qwen2-MoE, 512 wide, 8 experts, 2 layers
    python benchmarks/moe_experts.py --quick    # 64 wide, 4 experts (checks the script)

Random-weight models built from transformers configs with default settings (``use_cache=True``),
calibrated on windows of the bundled LM's training text as byte ids (vocabulary 256), probed on
held-out text. Reported per model and recipe: how many expert matrices were quantized, how many
fell back (RTN, or SpQR on an identity Hessian) for lack of routed tokens, bits per parameter of
everything quantized, the mean Hessian-weighted relative output error over the expert matrices (the
figure GPTQ and SpQR minimise), and the logits' relative error against the FP model. Writes
benchmarks/results/moe_experts.json.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import transformers as T
from results_file import results_file

import qcompiler as qc
from qcompiler.data import calibration_windows, stdlib_tokens
from qcompiler.evaluation.eval import bits_per_parameter
from qcompiler.files.atomic import write_text_atomically

SIZES = {
    "default": dict(hidden=512, inter=1024, experts=8, windows=16, seqlen=256),
    "quick": dict(hidden=64, inter=128, experts=4, windows=4, seqlen=32),
}


def build(arch: str, size: dict) -> torch.nn.Module:
    common = dict(
        vocab_size=256,
        hidden_size=size["hidden"],
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    if arch == "mixtral":
        config = T.MixtralConfig(
            **common, intermediate_size=size["inter"], num_local_experts=size["experts"], num_experts_per_tok=2
        )
    else:
        config = T.Qwen2MoeConfig(
            **common,
            intermediate_size=size["inter"],
            num_experts=size["experts"],
            num_experts_per_tok=2,
            moe_intermediate_size=size["inter"] // 2,
            shared_expert_intermediate_size=size["inter"] // 2,
        )
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, help="default: results/moe_experts.json (results/quick/ with --quick)")
    args = parser.parse_args()
    args.out = args.out or results_file("moe_experts", args.quick)
    size = SIZES["quick" if args.quick else "default"]
    windows = calibration_windows(size["windows"], size["seqlen"])  # the bundled LM's training split
    calibration = [{"input_ids": windows}]
    tokens = stdlib_tokens("heldout")
    probe = tokens[:64].reshape(1, 64)
    rows = []
    for arch in ("mixtral", "qwen2_moe"):
        model = build(arch, size)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fp = qc.compile(model, {"input_ids": probe}, recipe="none", progress=False)(input_ids=probe).logits
            for recipe in ("rtn-w4g128", "gptq-w4g128", "gptq-w3g128", "spqr-w3g16"):
                cm = qc.compile(model, {"input_ids": probe}, recipe=recipe, calibration=calibration, progress=False)
                experts = [r for r in cm.report.layer_table() if ".experts." in r["layer"]]
                logits = cm(input_ids=probe).logits
                rows.append(
                    dict(
                        model=arch,
                        recipe=recipe,
                        expert_matrices=len(experts),
                        fallbacks=sum("fallback" in r for r in experts),
                        bits_per_parameter=bits_per_parameter(cm.graph_module),
                        mean_expert_error=sum(r.get("rel_error", 0.0) for r in experts) / len(experts),
                        logit_error=((logits - fp).norm() / fp.norm()).item(),
                    )
                )
                r = rows[-1]
                print(
                    f"{arch:10s} {recipe:12s} experts {r['expert_matrices']:3d}  fallbacks {r['fallbacks']}  "
                    f"bits/param {r['bits_per_parameter']:.3f}  "
                    f"mean expert error {r['mean_expert_error']:.4f}  logit error {r['logit_error']:.4f}",
                    flush=True,
                )
    record = {"size": size, "torch": torch.__version__, "rows": rows}
    write_text_atomically(args.out, json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
