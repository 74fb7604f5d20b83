"""Quality tables of weight quantization and fp8 KV pools (python -m tlaloc_jax.tools.quality, for many artifacts).

    python bench/quality.py demo OUT_DIR         # the demo model (trained on the standard library)
    python bench/quality.py llama OUT_DIR        # a tiny seeded Llama (tests/hf_models.py; hidden 128), byte ids

Exports the unquantized model and each variant (int8, fp8, int4 in two group sizes (demo: 32 and 64, its hidden
size 192 is no multiple of 128; Llama: 32 and 128), each with f32 and fp8 KV pools;
fp8 KV alone; and the wrong-axis int8 control), serves each with the JAX-free runtime and compares it with the
unquantized one on a held-out standard-library file: fixture ids, perplexity, top-1 agreement. Prints a
markdown table.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

def variants(groups: tuple[int, int]) -> list[tuple[str, str, int, str, str]]:
    """(label, weight_quant, group, kv dtype, quant_axis) of each artifact compared with the unquantized one."""
    out = [("fp8 KV", "none", 0, "float8_e4m3fn", "output")]
    for label, quant, group in [("int8", "int8", 0), ("fp8", "fp8", 0),
                                (f"int4 g{groups[0]}", "int4", groups[0]), (f"int4 g{groups[1]}", "int4", groups[1])]:
        out += [(label, quant, group, "float32", "output"), (f"{label} + fp8 KV", quant, group, "float8_e4m3fn", "output")]
    return out + [("control: int8, codes along the input axis", "int8", 0, "float32", "input")]


def export(checkpoint: Path, out: Path, context: int, quant="none", group=128, kv="float32", axis="output") -> Path:
    """The checkpoint's artifact; axis "input" quantizes with the wrong-axis control (tests/quant_controls.py)."""
    from quant_controls import wrong_axis_export
    from tlaloc_jax.export import export_checkpoint
    if not (out / "tlaloc-serving.json").exists():
        with wrong_axis_export() if axis == "input" else contextlib.nullcontext():
            export_checkpoint(checkpoint, out, batch_ladder=(1,), context_ladder=(context,), prefill_chunk=16,
                              kv_dtype=kv, weight_quant=quant, quant_group=group or 128, progress=False)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    model, out = argv[0], Path(argv[1])
    tokens = int(argv[2]) if len(argv) > 2 else 480
    if model == "demo":
        from tlaloc_jax.tools.demo import DEMO_MODEL
        checkpoint, context, groups = Path(DEMO_MODEL), 256, (32, 64)     # hidden 192: 128 does not tile it
    elif model == "llama":
        from hf_models import build_checkpoint
        checkpoint, context, groups = out / "checkpoint", 512, (32, 128)
        if not (checkpoint / "config.json").exists():     # hidden 128 and MLP 256, so groups of 128 tile both
            build_checkpoint(checkpoint, "llama", seed=0, hidden_size=128, intermediate_size=256, head_dim=32)
    else:
        raise SystemExit("model: demo or llama")
    from tlaloc_jax.serve.engine import Engine
    from tlaloc_jax.tools.quality import compare, held_out_text, text_ids_for

    path, text = held_out_text()
    ref = export(checkpoint, out / "none", context)
    ids = text_ids_for(str(ref), text, tokens)
    rows = []
    with Engine.load(ref, progress=False) as ea:
        for label, quant, group, kv, axis in variants(groups):
            art = export(checkpoint, out / label.replace(" ", "_").replace(",", "").replace(":", "").replace("+", "p"),
                         context, quant, group, kv, axis)
            with Engine.load(art, progress=False) as eb:
                r = compare(ea, eb, ids, names=(ea.manifest.model.name, eb.manifest.model.name),
                            text_name=str(path))
            wbytes = sum(w.nbytes for w in eb.manifest.weights)
            rows.append((label, r, wbytes))
            print(f"{label}: {r.line()}", flush=True)
    base = sum(w.nbytes for w in ea.manifest.weights)
    print(f"\n{model} ({ea.manifest.model.name}), text {path.name} ({len(ids)} tokens), "
          f"unquantized perplexity {rows[0][1].perplexity_a:.4f}, weights {base / 2**20:.2f} MiB\n")
    print("| variant | weights MiB | fixture ids equal | teacher-forced | perplexity | change | top-1 agreement |")
    print("|---|---|---|---|---|---|---|")
    for label, r, wb in rows:
        print(f"| {label} | {wb / 2**20:.2f} | {r.fixture_ids_equal}/{r.fixture_ids} | "
              f"{r.fixture_teacher_forced}/{r.fixture_ids} | {r.perplexity_b:.4f} | "
              f"{100 * (r.perplexity_b / r.perplexity_a - 1):+.2f}% | {r.top1_agree}/{r.top1_positions} "
              f"({100 * r.top1_agree / r.top1_positions:.1f}%) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
