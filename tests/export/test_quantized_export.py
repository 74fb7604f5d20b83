"""Quantized weights and fp8 KV pools end to end: the exporter's --weight-quant / --kv-dtype fp8, the manifest's
record of each quantized weight (and its refusals at load), the JAX-free runtime serving the artifact against
transformers (near-tie rule, with the quantization counted in the tolerance model), the fp8 KV write and read,
and (slow) the quality check on the demo model and a tiny Llama with its wrong-axis control."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import test_paged_attention as tpa
import tlaloc_jax
from hf_models import build_checkpoint, load_hf_torch, torch_greedy
from margins import assert_within
from oracle import GreedyMismatch, check_greedy_batch, engine_next_token
from quant_controls import wrong_axis_export, wrong_axis_weights
from tlaloc_jax import artifact as af
from tlaloc_jax.checkpoint import load_checkpoint
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.export._quant import QUANTIZED_SLOTS, head_quant_for, quantize_weights
from tlaloc_jax.kernels import kv_cache_write, paged_attention_reference
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.quantized_matmul import QuantizedWeight, dequantize

PROMPTS = [[5, 17, 99, 3, 250, 8, 61], [7, 7, 7, 1, 2, 3, 200, 100, 11, 13, 17, 19]]
NEW = 12


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("q-llama"), "llama", seed=5)


@pytest.fixture(scope="module")
def int8_artifact(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("q-int8") / "art"
    export_checkpoint(llama, out, batch_ladder=(1,), context_ladder=(64,), weight_quant="int8", progress=False,
                      sampler=None)
    return out


def quant_logit_bound(checkpoint, scheme: str, group: int = 0, context: int = 64) -> float:
    """The tolerance model's bound on a logit of the quantized model against transformers' f32 one: the weights'
    own quantization roundoff (the largest over the quantized slots) and the f32 path's roundings."""
    cfg, weights = load_checkpoint(checkpoint, "float32")
    quant = quantize_weights(weights, scheme, group, compute="float32")
    u = max(tol.weight_quantization_roundoff(weights[s], dequantize(quant[s])) for s in QUANTIZED_SLOTS if s in quant)
    return tol.quantized_logit_bound(u, cfg.num_layers, tol.decoder_roundings_of(cfg, context))


def test_manifest_records_each_quantized_weight(int8_artifact):
    m = af.load_manifest(int8_artifact)
    assert m.model.name.endswith(":qint8")
    assert "tlaloc_projection_v1" in m.versions.custom_calls     # served through the C projection kernel
    by_slot = {w.slot: w for w in m.weights}
    # The per-layer layout (tlaloc_jax.layout): q|k|v and gate|up fused, then quantized, one file per layer.
    layers = m.model.layers
    for slot in ("attn.qkv_proj", "attn.o_proj", "layers.gate_up_proj", "layers.down_proj"):
        for i in range(layers):
            name = f"{slot}.{i}"
            codes, scales = by_slot[f"{name}.codes"], by_slot[f"{name}.scales"]
            assert (codes.dtype, scales.dtype) == ("int8", "float32")
            # Codes stored [out, in] (out-major, as the layout's float projections are): scales per output channel.
            assert codes.quant == af.WeightQuant(af.QuantScheme.INT8, af.QuantPart.CODES, name, 0, out_major=True)
            assert scales.shape == codes.shape[:1]
    # The output head stays float, stored [out, in] like the per-layer layout's other float projections.
    for slot in ("embed", "head.out_in", "final_norm", "layers.attn_norm.0", "layers.mlp_norm.0"):
        assert by_slot[slot].quant is None and by_slot[slot].dtype == "float32"


def test_export_cli_refuses_int4_groups_that_do_not_tile(llama, tmp_path, capsys):
    """--weight-quant int4 --quant-group 64 on a 96-wide MLP: exit 2, the message names the weight, nothing
    written."""
    from tlaloc_jax.export.__main__ import main

    assert main([str(llama), str(tmp_path / "art"), "--weight-quant", "int4", "--quant-group", "64", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "layers.down_proj" in err and "int4 groups of 64 do not tile 96" in err, err
    assert not (tmp_path / "art").exists()


def _tampered(src, dst, edit):
    shutil.copytree(src, dst)
    raw = json.loads((dst / af.MANIFEST_NAME).read_text())
    edit({w["slot"]: w for w in raw["weights"]}, raw)
    (dst / af.MANIFEST_NAME).write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda w, raw: w["attn.qkv_proj.0.codes"]["quant"].update(scheme="int3"), "not a known QuantScheme"),
    (lambda w, raw: w["attn.qkv_proj.0.codes"]["quant"].update(group=32), "group 32 is not 0"),
    (lambda w, raw: w["attn.qkv_proj.0.scales"]["quant"].update(part="codes"), "should be attn.qkv_proj.0.codes"),
    (lambda w, raw: w["attn.qkv_proj.0.scales"].update(quant=None), "'attn.qkv_proj.0' has no scales file"),
    (lambda w, raw: w["attn.qkv_proj.0.codes"]["quant"].update(scheme="fp8"), "float8_e4m3fn"),
], ids=["unknown-scheme", "int8-with-group", "part-mismatch", "scales-unmarked", "codes-dtype"])
def test_bad_quantization_entries_are_refused_at_load(int8_artifact, tmp_path, edit, message):
    bad = _tampered(int8_artifact, tmp_path / "bad", edit)
    with pytest.raises(af.ManifestError, match=message):
        af.load_manifest(bad)


@pytest.fixture(scope="module")
def uint4_artifact(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("q-uint4") / "art"
    export_checkpoint(llama, out, batch_ladder=(1,), context_ladder=(64,), weight_quant="uint4", quant_group=32,
                      progress=False, sampler=None)
    return out


@pytest.mark.parametrize("edit,message", [
    (lambda w, raw: w["attn.qkv_proj.0.zeros"].update(quant=None), "'attn.qkv_proj.0' has no zeros file"),
    (lambda w, raw: w["attn.qkv_proj.0.zeros"].update(dtype="uint8"), "uint4 zeros are int8"),
    (lambda w, raw: w["attn.qkv_proj.0.zeros"].update(shape=[2, 128]), "need zeros"),
    (lambda w, raw: [w[f"attn.qkv_proj.0.{p}"]["quant"].update(scheme="int4") for p in ("codes", "scales", "zeros")],
     "int4 weights have no zeros"),
], ids=["zeros-unmarked", "zeros-dtype", "zeros-shape", "int4-with-zeros"])
def test_bad_uint4_entries_are_refused_at_load(uint4_artifact, tmp_path, edit, message):
    bad = _tampered(uint4_artifact, tmp_path / "bad", edit)
    with pytest.raises(af.ManifestError, match=message):
        af.load_manifest(bad)


def _check_against_dequantized(checkpoint, artifact, scheme: str, tmp_path, spoil) -> None:
    """The artifact (`scheme`, groups of 32, served through the native int4 kernel, its head int8 as the exporter's
    default): greedy ids against transformers running the weights the codes stand for (the dequantized checkpoint,
    its head too), near-tie rule at the f32
    bound plus the kernel's int8 quantization of each projection's input (INT8_ACTIVATION_ROUNDOFF; both sides
    hold the same weights). Control: the model with spoil(weight) for each quantized weight fails the check."""
    from tlaloc_jax.checkpoint import read_config, save_checkpoint
    from tlaloc_jax.serve.engine import Engine

    cfg, weights = load_checkpoint(checkpoint, "float32")
    quant = quantize_weights(weights, scheme, 32, compute="float32", head=head_quant_for(scheme, None))
    deq = {k: (dequantize(v).astype(np.float32) if isinstance(v, QuantizedWeight) else v) for k, v in quant.items()}
    save_checkpoint(tmp_path / "deq", read_config(checkpoint), deq)
    want = [torch_greedy(load_hf_torch(tmp_path / "deq"), p, NEW) for p in PROMPTS]
    bound = tol.quantized_logit_bound(0.0, cfg.num_layers, tol.decoder_roundings_of(cfg, 64),
                                      activation_roundoff=tol.INT8_ACTIVATION_ROUNDOFF)
    with Engine.load(artifact, progress=False) as engine:
        check_greedy_batch(PROMPTS, engine.generate(PROMPTS, NEW), want, logit_bound=bound,
                           next_token=engine_next_token(engine))
    wrong = tlaloc_jax.Model(cfg, {k: spoil(v) if isinstance(v, QuantizedWeight) and k != "head" else v
                                   for k, v in quant.items()})
    with pytest.raises(GreedyMismatch):
        check_greedy_batch(PROMPTS, wrong.generate(PROMPTS, max_new_tokens=NEW), want, logit_bound=bound,
                           next_token=engine_next_token(wrong))


@pytest.mark.numeric
def test_served_uint4_matches_the_dequantized_checkpoint(llama, uint4_artifact, tmp_path):
    """--weight-quant uint4: each projection's codes, scales and int8 zero points recorded; served, its greedy
    ids against transformers running the weights the codes stand for (near-tie rule at the f32 bound, both sides
    holding the same weights, and the native int4 kernel's int8 quantization of each projection's input).
    Control: the zero points dropped (read as 0) fail the same check."""
    m = af.load_manifest(uint4_artifact)
    assert m.model.name.endswith(":quint4g32")
    by_slot = {w.slot: w for w in m.weights}
    for i in range(m.model.layers):
        zeros, scales = by_slot[f"layers.down_proj.{i}.zeros"], by_slot[f"layers.down_proj.{i}.scales"]
        assert zeros.quant == af.WeightQuant(af.QuantScheme.UINT4, af.QuantPart.ZEROS, f"layers.down_proj.{i}", 32,
                                             out_major=True)
        assert zeros.dtype == "int8" and zeros.shape == scales.shape == (64, 96 // 32)
    _check_against_dequantized(llama, uint4_artifact, "uint4", tmp_path,
                               lambda q: dataclasses.replace(q, zeros=np.zeros_like(q.zeros)))


@pytest.mark.numeric
def test_served_int8_keeps_transformers_greedy_ids(llama, int8_artifact):
    """The runtime serving int8 weights against transformers' f32 model: equal greedy ids up to near-ties
    within the tolerance model's bound, which counts the weights' quantization roundoff. Control: the model
    with its codes quantized along the input axis (scales per output channel) fails the same check."""
    from tlaloc_jax.serve.engine import Engine

    bound = quant_logit_bound(llama, "int8")
    want = [torch_greedy(load_hf_torch(llama), p, NEW) for p in PROMPTS]
    with Engine.load(int8_artifact, progress=False) as engine:
        got = engine.generate(PROMPTS, NEW)
        check_greedy_batch(PROMPTS, got, want, logit_bound=bound, next_token=engine_next_token(engine))
    cfg, weights = load_checkpoint(llama, "float32")
    wrong = tlaloc_jax.Model(cfg, wrong_axis_weights(weights, "int8", 0, compute="float32"))
    with pytest.raises(GreedyMismatch):
        check_greedy_batch(PROMPTS, wrong.generate(PROMPTS, max_new_tokens=NEW), want, logit_bound=bound,
                           next_token=engine_next_token(wrong))


def _nibbles_swapped(q: QuantizedWeight) -> QuantizedWeight:
    """An int4 weight with each byte's nibbles swapped: a wrong packing order."""
    u = np.asarray(q.codes).view(np.uint8)
    return dataclasses.replace(q, codes=((u >> 4) | (u << 4)).astype(np.uint8).view(np.int8))


def test_head_is_int8_by_default_for_4_bit_and_head_quant_is_refused_by_name(llama, uint4_artifact, tmp_path):
    """A 4-bit artifact's head is int8 codes with a scale per output channel (out-major) by default; head_quant
    "none" keeps it in the weight dtype; an unknown scheme, or an int8 head without quantized projections, is
    refused by name."""
    from tlaloc_jax.export import ExportError

    by_slot = {w.slot: w for w in af.load_manifest(uint4_artifact).weights}
    codes, scales = by_slot["head.codes"], by_slot["head.scales"]
    assert codes.quant == af.WeightQuant(af.QuantScheme.INT8, af.QuantPart.CODES, "head", 0, out_major=True)
    assert codes.dtype == "int8" and scales.shape == codes.shape[:1] and "head.out_in" not in by_slot
    small = dict(batch_ladder=(1,), context_ladder=(64,), progress=False, sampler=None)
    m = export_checkpoint(llama, tmp_path / "kept", weight_quant="int4", quant_group=32, head_quant="none", **small)
    kept = {w.slot: w for w in m.weights}["head.out_in"]
    assert kept.quant is None and kept.dtype == "float32"
    with pytest.raises(ExportError, match="head_quant 'int4' is not one of none, int8"):
        export_checkpoint(llama, tmp_path / "bad", weight_quant="int4", head_quant="int4", **small)
    with pytest.raises(ExportError, match=r"head_quant 'int8' \(--head-quant\) .* pass weight_quant"):
        export_checkpoint(llama, tmp_path / "bad", head_quant="int8", **small)
    assert not (tmp_path / "bad").exists()


@pytest.mark.numeric
def test_served_int4_matches_the_dequantized_checkpoint(llama, tmp_path):
    """int4 (groups of 32) served through the native int4 kernel: greedy ids against transformers running the
    weights the codes stand for (the dequantized checkpoint), near-tie rule at a bound of the f32 roundings and
    the kernel's int8 quantization of each projection's input (INT8_ACTIVATION_ROUNDOFF). Control: the same
    codes with each byte's nibbles swapped (a wrong packing order) fail the same check."""
    from tlaloc_jax.kernels.projection_native import NATIVE_INT4_PROJECTION

    m = export_checkpoint(llama, tmp_path / "art", batch_ladder=(1, 2), context_ladder=(64,), weight_quant="int4",
                          quant_group=32, progress=False, sampler=None)
    assert NATIVE_INT4_PROJECTION in m.versions.custom_calls
    _check_against_dequantized(llama, tmp_path / "art", "int4", tmp_path, _nibbles_swapped)


@pytest.mark.numeric
def test_fp8_kv_write_clamps_and_attention_widens():
    """kv_cache_write into an e4m3fn pool stores each key and value rounded to e4m3fn, clamped to +-448 (no NaN
    past it); paged attention over the fp8 pool equals the reference over the same codes widened to f32.
    Control: the unclamped convert gives NaN."""
    call = tpa.make_call(0, [20, 9], [8, 8])
    pool = jnp.zeros(call.kv_pool.shape, jnp.float8_e4m3fn)
    B, T = call.positions.shape
    K, D = pool.shape[4], pool.shape[5]
    rng = np.random.default_rng(1)
    k = rng.standard_normal((B, T, K, D)).astype(np.float32)
    v = rng.standard_normal((B, T, K, D)).astype(np.float32) * 100
    v[0, -1, 0, :3] = [1000.0, -1e6, 447.0]
    slots = np.where(call.positions >= 0, np.asarray(call.block_tables)[
        np.arange(B)[:, None], np.maximum(call.positions, 0) // tpa.S] * tpa.S + np.asarray(call.positions) % tpa.S, -1)
    new = jax.jit(kv_cache_write)(pool, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots, jnp.int32), 1)
    page, off = divmod(int(slots[0, -1]), tpa.S)
    stored = np.asarray(new[1, 1, page, off, 0, :3]).astype(np.float32)
    assert stored.tolist() == [448.0, -448.0, 448.0]           # 447 rounds to 448 in e4m3fn
    live = slots >= 0
    for i, x in enumerate((k, v)):
        want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        got = np.asarray(new[1, i]).astype(np.float32)[slots[live] // tpa.S, slots[live] % tpa.S]
        np.testing.assert_array_equal(got, want[live])
    assert np.isnan(np.float32(1e6).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))    # the control
    fp8_call = call._replace(kv_pool=new)
    out = tpa.fast(fp8_call, 0, key_block=tpa.KEY_BLOCK)
    ref = paged_attention_reference(*call._replace(kv_pool=new.astype(jnp.float32)), scale=tpa.SCALE)
    mask = np.asarray(call.positions >= 0)
    assert_within(tol.relative_error(np.asarray(out)[mask], np.asarray(ref)[mask]), tpa.BOUND, "fp8 KV pool read")


# --- slow: the quality check -------------------------------------------------------------------------


def _quality(checkpoint, tmp_path, context, variants):
    from tlaloc_jax.serve.engine import Engine
    from tlaloc_jax.tools.quality import compare, held_out_text, text_ids_for

    def export(name, wrong_axis=False, **kw):
        with wrong_axis_export() if wrong_axis else contextlib.nullcontext():
            export_checkpoint(checkpoint, tmp_path / name, batch_ladder=(1,), context_ladder=(context,),
                              prefill_chunk=16, prefill_long_chunk=0, progress=False, **kw)
        return tmp_path / name

    ref = export("none")
    _, text = held_out_text()
    ids = text_ids_for(str(ref), text, 240)
    reports = {}
    with Engine.load(ref, progress=False) as ea:
        for name, kw in variants.items():
            with Engine.load(export(name, **kw), progress=False) as eb:
                reports[name] = compare(ea, eb, ids)
    return reports, ids


@pytest.mark.slow
@pytest.mark.numeric
@pytest.mark.parametrize("model", ["demo", "llama"])
def test_quality_int8_keeps_fixture_ids_and_the_wrong_axis_is_caught(model, tmp_path):
    """int8 weights keep the unquantized model's fixture ids (near-tie rule against transformers) and its
    perplexity within a few percent; the wrong-axis control (codes per input channel under per-output-channel
    scales) loses the ids, the top-1 agreement and the perplexity, as the seed's check requires."""
    from tlaloc_jax.serve.engine import Engine
    from tlaloc_jax.tools.demo import DEMO_MODEL
    from tlaloc_jax.tools.quality import fixture_prompts

    checkpoint = DEMO_MODEL if model == "demo" else build_checkpoint(tmp_path / "ck", "llama", seed=0)
    context = 256 if model == "demo" else 512
    reports, ids = _quality(checkpoint, tmp_path, context, {
        "int8": dict(weight_quant="int8"), "wrong": dict(weight_quant="int8", wrong_axis=True)})
    good, wrong = reports["int8"], reports["wrong"]
    # The CLI over the same artifacts reports the same measures (its own text and fixtures: a shorter run).
    from tlaloc_jax.tools.quality import main as quality_main
    assert quality_main([str(tmp_path / "none"), str(tmp_path / "int8"), "--tokens", "64", "--fixtures", "1",
                         "--json"]) == 0
    assert abs(good.perplexity_b / good.perplexity_a - 1) < 0.05, good
    assert good.top1_agree >= 0.9 * good.top1_positions, good
    assert good.fixture_ids_equal > 2 * wrong.fixture_ids_equal and good.top1_agree > 1.2 * wrong.top1_agree
    # How far the wrong axis moves the perplexity depends on how unequal the channels' largest weights are (the
    # wrong codes are W[i, o] s_out[o] / s_in[i]): the seed's Qwen3 went to 3.4 million; these models' weights
    # have far more even channels (the demo: +25%). The random Llama's perplexity on text means nothing (it is
    # above its vocabulary either way), so only its ids and top-1 agreement are held to it.
    if model == "demo":
        assert wrong.perplexity_b > 1.1 * wrong.perplexity_a, wrong
    assert wrong.fixture_ids_equal < wrong.fixture_ids // 2, wrong
    assert wrong.top1_agree < 0.8 * wrong.top1_positions, wrong
    # The fixture ids against transformers, near-tie rule, on the served int8 artifact; and the control fails it.
    bound = quant_logit_bound(checkpoint, "int8", context=context)
    torch_model = load_hf_torch(checkpoint)
    prompts = fixture_prompts(ids, 3, 16)        # the quality check's own fixtures, cut from the text
    want = [torch_greedy(torch_model, p, 16) for p in prompts]
    for name, ok in (("int8", True), ("wrong", False)):
        with Engine.load(tmp_path / name, progress=False) as engine:
            run = lambda: check_greedy_batch(prompts, engine.generate(prompts, 16), want,  # noqa: E731
                                             logit_bound=bound, next_token=engine_next_token(engine))
            if ok:
                run()
            else:
                with pytest.raises(GreedyMismatch):
                    run()


@pytest.mark.slow
@pytest.mark.numeric
def test_served_int8_experts_match_the_dequantized_checkpoint(tmp_path):
    """A mixture-of-experts model with its routed experts quantized per expert and output channel, served:
    its greedy ids against transformers running the weights the codes stand for (the dequantized checkpoint),
    near-tie rule at the f32 bound, since both sides hold the same weights. Control: the wrong-axis codes."""
    from tlaloc_jax.checkpoint import read_config, save_checkpoint
    from tlaloc_jax.kernels.quantized_matmul import QuantizedWeight
    from tlaloc_jax.serve.engine import Engine

    ck = build_checkpoint(tmp_path / "ck", "qwen3_moe", seed=3)
    export_checkpoint(ck, tmp_path / "art", batch_ladder=(1,), context_ladder=(64,), weight_quant="int8",
                      progress=False, sampler=None)
    m = af.load_manifest(tmp_path / "art")
    cfg, weights = load_checkpoint(ck, "float32")
    assert {w.slot for w in m.weights if w.quant} >= {f"layers.expert_{p}.{i}.{part}" for p in ("gate", "up", "down")
                                                      for part in ("codes", "scales") for i in range(cfg.num_layers)}
    quant = quantize_weights(weights, "int8", 0, compute="float32")
    deq = {k: (dequantize(v).astype(np.float32) if isinstance(v, QuantizedWeight) else v) for k, v in quant.items()}
    save_checkpoint(tmp_path / "deq", read_config(ck), deq)
    oracle = load_hf_torch(tmp_path / "deq")
    want = [torch_greedy(oracle, p, NEW) for p in PROMPTS]
    bound = tol.bound(tol.decoder_roundings_of(cfg, 64))
    with Engine.load(tmp_path / "art", progress=False) as engine:
        check_greedy_batch(PROMPTS, engine.generate(PROMPTS, NEW), want, logit_bound=bound,
                           next_token=engine_next_token(engine))
    wrong = tlaloc_jax.Model(cfg, wrong_axis_weights(weights, "int8", 0, compute="float32"))
    with pytest.raises(GreedyMismatch):
        check_greedy_batch(PROMPTS, wrong.generate(PROMPTS, max_new_tokens=NEW), want, logit_bound=bound,
                           next_token=engine_next_token(wrong))
