"""Decode entries for cuda: plain ops by default, the Pallas GPU kernel (tlaloc_jax/kernels/paged_attention_gpu.py) on request.

The default is the verdict docs/gpu.md records from `python -m bench.gpu run`; the decoder's decode step with the kernel
(in Pallas' interpreter, on CPU) against the plain-ops step; an export for cuda with the kernel on this CPU machine
holds the GPU plugin's Triton custom call in its decode bodies and nowhere else, an export for cpu holds none; and
the custom-call check allows that target on cuda only.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from margins import assert_within
from tlaloc_jax import artifact as af
from tlaloc_jax.checkpoint import random_weights, save_checkpoint
from tlaloc_jax.decoder import forward, init_pools
from tlaloc_jax.export import ExportError, check_custom_calls, custom_call_targets, export_checkpoint
from tlaloc_jax.kernels.paged_attention_native import NATIVE_DECODE_ATTENTION
from tlaloc_jax.export._artifact import CUDA_DECODE_ATTENTION
from tlaloc_jax.families import config_from_hf
from tlaloc_jax.inputs import StepInputs
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.paged_attention_gpu import TRITON_CUSTOM_CALL
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs

# Gemma 2's shape in small: sliding layers (window 8, kept in rings) beside full ones, soft-capped scores, GQA 2.
GEMMA2 = dict(model_type="gemma2", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
              rms_norm_eps=1e-6, sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
              final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
S = 4           # page size
WIDTH = 12      # block-table width: context 48
RING = 4        # ring pages: window 8 - 1 + a prefill of up to 9 tokens


@pytest.mark.numeric
def test_decode_step_with_the_pallas_kernel_matches_plain_ops():
    """One decode step of two rows (positions 13 and 30; the longer one has wrapped its ring) over pools of
    random keys and values, through each attention: the same logits and pools within the decoder's bound.
    Control: the decode token one position short changes the logits far beyond it."""
    fam, cfg = config_from_hf(GEMMA2)
    weights = {k: jnp.asarray(v) for k, v in random_weights(cfg, fam, seed=5).items()}
    rng = np.random.default_rng(0)
    pools = {name: jnp.asarray(rng.standard_normal(p.shape), p.dtype)
             for name, p in init_pools(cfg, 2 * WIDTH, S, window_blocks=2 * RING).items()}
    pages = [list(range(0, WIDTH)), list(range(WIDTH, 2 * WIDTH))]
    rings = [list(range(0, RING)), list(range(RING, 2 * RING))]
    decode = StepInputs(**{k: jnp.asarray(v) for k, v in build_step_inputs(
        [RowCall([7], 13, pages[0], rings[0]), RowCall([9], 30, pages[1], rings[1])],
        batch=2, tokens=1, width=WIDTH, block_size=S, ring_pages=RING).items()})
    step = jax.jit(functools.partial(forward, cfg, ring_pages=RING), static_argnames="decode_attention")
    want, want_pools = step(weights, pools, decode, decode_attention="xla")
    got, got_pools = step(weights, pools, decode, decode_attention="pallas-interpret")
    assert np.all(np.isfinite(got))
    bound = tol.bound(tol.decoder_roundings_of(cfg, WIDTH * S))
    assert_within(tol.relative_error(got, want), bound, "gemma2 decode step, pallas kernel vs plain ops")
    for name in want_pools:   # the second layer's keys and values come from the first layer's attention
        assert_within(tol.relative_error(got_pools[name], want_pools[name]), bound, f"pool {name!r} after the step")
    shifted = decode._replace(positions=decode.positions - 1)
    wrong, _ = step(weights, pools, shifted, decode_attention="pallas-interpret")
    assert tol.relative_error(wrong, want) > 100 * bound


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = dict(GEMMA2, num_hidden_layers=2)   # one sliding, one full layer
    fam, cfg = config_from_hf(hf)
    return save_checkpoint(tmp_path_factory.mktemp("gemma2") / "ck", hf, random_weights(cfg, fam, seed=6))


def _targets(art, m: af.Manifest) -> dict[str, set[str]]:
    return {e.name: custom_call_targets((art / e.body).read_text()) for e in m.entries}


GPU_DOC = Path(__file__).resolve().parents[2] / "docs" / "gpu.md"


def recorded_verdict() -> str:
    """The decode attention docs/gpu.md records as the cuda default (the line bench/gpu.py's verdict fills in)."""
    found = re.findall(r"^Recorded verdict: cuda decode attention default `(\w+)`", GPU_DOC.read_text(), re.M)
    assert len(found) == 1, f"{GPU_DOC} must hold one 'Recorded verdict' line, found {found}"
    return found[0]


def test_cuda_default_is_the_recorded_verdict(checkpoint, tmp_path):
    """The exporter's cuda default is the decode attention the recorded GPU run chose (plain ops until a run shows
    the Pallas kernel correct and faster), and an export for cuda that names none holds no Triton call."""
    assert CUDA_DECODE_ATTENTION == recorded_verdict()
    cuda = export_checkpoint(checkpoint, tmp_path / "cuda", platform="cuda", batch_ladder=(1,), context_ladder=(32,),
                             block_size=S, progress=False, mlir=True)
    want = {TRITON_CUSTOM_CALL} if CUDA_DECODE_ATTENTION == "pallas" else set()
    targets = _targets(tmp_path / "cuda", cuda)
    for e in cuda.entries:
        assert targets[e.name] == (want if e.kind == af.EntryKind.DECODE else set()), e.name


def test_cuda_export_puts_the_triton_kernel_in_decode_bodies_only(checkpoint, tmp_path):
    """Lowered for cuda with the Pallas kernel on this CPU machine (no GPU, no CUDA plugin): each decode body (and
    each mixed body, whose decode rows attend with it) holds the Triton custom call (once, inside the layer scan,
    for the ring layer and the full one alike), prefill bodies none; the same checkpoint exported for cpu holds the
    native C kernel's call in the same bodies by default (its full layer; the ring layer keeps plain ops), and with
    decode_attention 'xla' no custom call at all (the cpu exports' projections kept in XLA's forms here, so that
    only attention calls the kernels)."""
    ladder = dict(batch_ladder=(1,), context_ladder=(32,), block_size=S, progress=False, mlir=True)
    cuda = export_checkpoint(checkpoint, tmp_path / "cuda", platform="cuda", decode_attention="pallas", **ladder)
    assert cuda.versions.platform == "cuda"
    targets = _targets(tmp_path / "cuda", cuda)
    for e in cuda.entries:
        assert targets[e.name] == ({TRITON_CUSTOM_CALL} if e.kind in (af.EntryKind.DECODE, af.EntryKind.MIXED) else set()), e.name
    cpu = export_checkpoint(checkpoint, tmp_path / "cpu", platform="cpu", projections="xla", **ladder)
    assert cpu.versions.custom_calls == (NATIVE_DECODE_ATTENTION,)
    targets = _targets(tmp_path / "cpu", cpu)
    for e in cpu.entries:
        assert targets[e.name] == ({NATIVE_DECODE_ATTENTION} if e.kind in (af.EntryKind.DECODE, af.EntryKind.MIXED)
                                   else set()), e.name
    plain = export_checkpoint(checkpoint, tmp_path / "plain", platform="cpu", decode_attention="xla", projections="xla",
                              **ladder)
    assert plain.versions.custom_calls == () and all(t == set() for t in _targets(tmp_path / "plain", plain).values())


def test_decode_attention_choices_are_checked(checkpoint, tmp_path):
    with pytest.raises(ExportError, match="only the cuda plugin compiles; platform 'cpu' takes decode_attention 'xla'"):
        export_checkpoint(checkpoint, tmp_path / "a", platform="cpu", decode_attention="pallas", progress=False)
    with pytest.raises(ExportError, match="decode_attention 'native' is a C kernel for the CPU; platform 'cuda'"):
        export_checkpoint(checkpoint, tmp_path / "d", platform="cuda", decode_attention="native", progress=False)
    with pytest.raises(ExportError, match="decode_attention 'triton' is not one of native, pallas, xla"):
        export_checkpoint(checkpoint, tmp_path / "b", platform="cuda", decode_attention="triton", progress=False)
    with pytest.raises(ExportError, match=r"Pallas GPU decode-attention kernel cannot serve this model: page size 6"):
        export_checkpoint(checkpoint, tmp_path / "c", platform="cuda", decode_attention="pallas", block_size=6,
                          context_ladder=(36,),
                          attention_block=36, progress=False)


def test_custom_call_check_allows_triton_on_cuda_only():
    body = f'%0 = stablehlo.custom_call @{TRITON_CUSTOM_CALL}(%arg0) {{api_version = 4 : i32}}'
    check_custom_calls("decode_b1_c32", body, "cuda")
    with pytest.raises(ExportError, match=r"custom_call '__gpu\$xla.gpu.triton', which the cpu PJRT plugin does not "
                                          r"provide \(only on cuda\)"):
        check_custom_calls("decode_b1_c32", body, "cpu")
    # jaxlib 0.11's form of a Pallas kernel: PTX compiled by jaxlib, run by a handler jaxlib's CUDA plugin
    # registers at import; the standalone plugin has no such handler.
    ffi = body.replace(TRITON_CUSTOM_CALL, "triton_kernel_call_ffi")
    with pytest.raises(ExportError, match="custom_call 'triton_kernel_call_ffi', which the cuda PJRT plugin"):
        check_custom_calls("decode_b1_c32", ffi, "cuda")
