"""The wrong-axis control on a model with outlier input channels: does its perplexity explode, as the seed's did?

The seed's wrong-axis control (int8 codes rounded against per-input-channel scales, stored with the per-output-channel
ones) sent Qwen3's perplexity to millions. The wrong codes are W[i, o] * s_out[o] / s_in[i]: the damage grows with how
unequal the input channels' largest weights are, and the demo model's channels are even (its wrong axis costs
+27%). Trained LLMs have outlier channels. This makes the demo model have them without changing what it computes:
each channel j of a norm that feeds q, k, v (or gate, up) is divided by f_j and the weight rows that read channel j
are multiplied by f_j (SmoothQuant's migration run backwards; f log-normal, sigma 1.5, seeded). Then it exports the
unquantized model, int8, and the wrong-axis int8 of both checkpoints and prints the quality check
(tlaloc_jax.tools.quality.compare) of each against the unquantized demo, on the held-out text.

    python bench/quality_outliers.py OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from quality import export  # noqa: E402


def with_outlier_channels(src: Path, dst: Path, sigma: float = 1.5, seed: int = 1) -> Path:
    """A copy of a Llama checkpoint computing the same function with outlier input channels."""
    from safetensors.numpy import load_file, save_file
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    (f,) = dst.glob("*.safetensors")
    w = load_file(f)
    rng = np.random.default_rng(seed)
    layers = sum(1 for k in w if k.endswith("input_layernorm.weight"))
    for i in range(layers):
        p = f"model.layers.{i}."
        for norm, projs in (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))):
            fac = np.exp(rng.normal(0.0, sigma, w[p + norm + ".weight"].shape[0])).astype(np.float32)
            w[p + norm + ".weight"] = (w[p + norm + ".weight"] / fac).astype(np.float32)
            for proj in projs:
                w[p + proj + ".weight"] = (w[p + proj + ".weight"] * fac[None, :]).astype(np.float32)
    save_file(w, str(f), metadata={"format": "pt"})
    return dst


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0])
    from tlaloc_jax.serve.engine import Engine
    from tlaloc_jax.tools.demo import DEMO_MODEL
    from tlaloc_jax.tools.quality import compare, held_out_text, text_ids_for

    demo = Path(DEMO_MODEL)
    outliers = with_outlier_channels(demo, out / "demo_outliers_checkpoint")
    path, text = held_out_text()
    ref = export(demo, out / "demo" / "none", 256)
    ids = text_ids_for(str(ref), text, 480)
    print(f"text {path.name} ({len(ids)} tokens); each row against the unquantized demo model")
    with Engine.load(ref, progress=False) as ea:
        for name, ck in (("demo", demo), ("demo, outlier channels", outliers)):
            tag = name.replace(", ", "_").replace(" ", "_")
            arts = [("unquantized", export(ck, out / tag / "none", 256))] if ck is not demo else []
            arts += [(label, export(ck, out / tag / label.replace(" ", "_"), 256, "int8", 0, "float32", axis))
                     for label, axis in (("int8", "output"), ("wrong-axis int8", "input"))]
            for label, art in arts:
                with Engine.load(art, progress=False) as eb:
                    r = compare(ea, eb, ids, names=("demo", label), text_name=str(path))
                print(f"{name}, {label}: perplexity {r.perplexity_a:.2f} -> {r.perplexity_b:.2f} "
                      f"({r.perplexity_b / r.perplexity_a:.3g}x), fixture ids {r.fixture_ids_equal}/{r.fixture_ids}, "
                      f"top-1 {r.top1_agree}/{r.top1_positions}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
