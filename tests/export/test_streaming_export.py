"""The streaming export: export_checkpoint reads, converts, quantizes, hashes and writes one weight file (a layer's
tensor) at a time. Its artifact is byte for byte the one the load-everything path writes (loaded_weights, kept as
the reference), for f32, bf16, int8, int4 and uint4 and both weight layouts, from one safetensors file or bf16 shards; the
weight pass' peak memory is a few tensors, not the model, and the load-everything reference fails that bound; stage
takes lazy weights (loaders, or objects with shape, dtype and load()); the progress is plain lines off a terminal."""

from __future__ import annotations

import io
import json
import tracemalloc

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tlaloc_jax
from test_stage import LADDER, E, toy_step, toy_weights
from tlaloc_jax import ModelInfo
from tlaloc_jax import artifact as af
from tlaloc_jax.checkpoint import checkpoint_tensors, random_weights, read_config, save_checkpoint
from tlaloc_jax.export import ExportError, export_checkpoint
from tlaloc_jax.export import _artifact
from tlaloc_jax.export._checkpoint_weights import loaded_weights, streamed_weights
from tlaloc_jax.export._files import write_weights
from tlaloc_jax.export._progress import LineProgress, progress_bar
from tlaloc_jax.export._quant import quant_records
from tlaloc_jax.export._weights import flatten_weights
from tlaloc_jax.families import config_from_hf

HF = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
          tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
SMALL = dict(batch_ladder=(1,), context_ladder=(32,), prefill_chunk=16, prefill_long_chunk=None, block_size=16,
             mixed=False, packed=False, progress=False)


@pytest.fixture(scope="module")
def f32_checkpoint(tmp_path_factory):
    fam, cfg = config_from_hf(HF)
    return save_checkpoint(tmp_path_factory.mktemp("f32") / "ck", HF, random_weights(cfg, fam, seed=3, std=0.05))


@pytest.fixture(scope="module")
def bf16_checkpoint(f32_checkpoint, tmp_path_factory):
    """The f32 checkpoint's tensors as bf16 in two shards with an index, as Hugging Face shards them."""
    from safetensors.flax import save_file
    from safetensors.numpy import load_file
    tensors = load_file(str(f32_checkpoint / "model.safetensors"))
    out = tmp_path_factory.mktemp("bf16") / "ck"
    out.mkdir()
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2]), 1):
        fname = f"model-{k:05d}-of-00002.safetensors"
        save_file({n: jnp.asarray(tensors[n].astype(ml_dtypes.bfloat16)) for n in part}, str(out / fname))
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(dict(HF, torch_dtype="bfloat16")))
    return out


def _export_both(checkpoint, out, monkeypatch, **kw):
    """The artifact exported streamed and with the load-everything reference swapped in -> (their manifests' text,
    {weight file: (streamed bytes, reference bytes)})."""
    streamed = export_checkpoint(checkpoint, out / "streamed", **SMALL, **kw)
    with monkeypatch.context() as m:
        m.setattr(_artifact, "streamed_weights", loaded_weights)
        reference = export_checkpoint(checkpoint, out / "loaded", **SMALL, **kw)
    files = {w.file: ((out / "streamed" / w.file).read_bytes(), (out / "loaded" / w.file).read_bytes())
             for w in streamed.weights}
    return (streamed.to_json(), reference.to_json()), files


@pytest.mark.parametrize("source,dtype,quant,layout", [
    ("f32", "float32", "none", "per-layer"),
    ("bf16", "bfloat16", "none", "per-layer"),
    ("f32", "float32", "int8", "per-layer"),
    ("bf16", "bfloat16", "int4", "per-layer"),
    ("bf16", "bfloat16", "uint4", "per-layer"),
    ("f32", "float32", "uint4", "stacked"),
    ("bf16", "float32", "int8", "stacked"),
    ("f32", "bfloat16", "int4", "stacked"),
])
def test_streamed_artifact_is_byte_identical_to_the_loaded_one(source, dtype, quant, layout, f32_checkpoint,
                                                               bf16_checkpoint, tmp_path, monkeypatch):
    checkpoint = {"f32": f32_checkpoint, "bf16": bf16_checkpoint}[source]
    (streamed, reference), files = _export_both(checkpoint, tmp_path, monkeypatch, weight_dtype_name=dtype,
                                                weight_quant=quant, quant_group=32, weight_layout=layout)
    assert streamed == reference          # the same weight files, names, shapes, dtypes and sha256s
    assert files and all(a == b for a, b in files.values())
    quantized = [w for w in json.loads(streamed)["weights"] if w.get("quant")]
    assert bool(quantized) == (quant != "none")


def _weight_pass(checkpoint, out, read, **kw):
    """Build the weights with `read` and write their files, under tracemalloc (which numpy reports to) -> the peak
    bytes allocated. A first pass, untraced, imports and compiles what the pass uses: those are not the weights'."""
    fam, cfg = config_from_hf(read_config(checkpoint))

    def run(to):
        weights = read(checkpoint, fam, cfg, **kw)
        flat, _ = flatten_weights(weights)
        write_weights(to, flat, progress_bar(len(flat), "weights", False), quant_records(weights))
    run(out / "warm")
    tracemalloc.start()
    try:
        run(out / "traced")
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_weight_pass_peak_is_a_few_tensors_not_the_model(quant, tmp_path):
    """Twenty layers: the model is about 90 of its largest tensors (f32 bytes). The streamed pass stays within 12
    (a projection is read in f32 and gate | up joined: twice the largest; its codes; and a copy more or less where
    numpy and XLA hand a buffer over with or without copying it); the load-everything reference, the control, holds
    the whole model and fails the same bound."""
    hf = dict(HF, num_hidden_layers=20, vocab_size=64, hidden_size=256, intermediate_size=512, num_attention_heads=8,
              num_key_value_heads=4, head_dim=32)
    fam, cfg = config_from_hf(hf)
    checkpoint = save_checkpoint(tmp_path / "ck", hf, random_weights(cfg, fam, seed=1))
    shapes = checkpoint_tensors(fam, cfg).values()
    largest, model = max(4 * int(np.prod(s)) for s in shapes), sum(4 * int(np.prod(s)) for s in shapes)
    assert model > 80 * largest
    kw = dict(dtype="float32", layout="per-layer", quant=quant, group=32)
    streamed = _weight_pass(checkpoint, tmp_path / "streamed", streamed_weights, **kw)
    loaded = _weight_pass(checkpoint, tmp_path / "loaded", loaded_weights, **kw)
    assert streamed <= 12 * largest, (streamed, largest)
    assert loaded > 12 * largest, (loaded, largest)      # the control: the bound catches a pass that loads it all


def _stage_toy(weights, out):
    return tlaloc_jax.stage(toy_step, weights, {"state": tlaloc_jax.StateSlots((E,))}, out, progress=False,
                            model=ModelInfo(name="toy", embedding_slot="embed"), **LADDER)


class _OnDisk:
    """An author's lazy weight: shape and dtype known, values read from a .npy file when its weight is written."""

    def __init__(self, path):
        self.path = path
        a = np.load(path, mmap_mode="r")
        self.shape, self.dtype = a.shape, a.dtype

    def load(self):
        return np.load(self.path)


def test_stage_takes_lazy_weights_and_writes_the_same_artifact(tmp_path):
    arrays = toy_weights()
    for k, v in arrays.items():
        np.save(tmp_path / f"{k}.npy", v)
    lazy = {"embed": _OnDisk(tmp_path / "embed.npy"), "decay": lambda: toy_weights()["decay"],
            "mix": _OnDisk(tmp_path / "mix.npy"), "head": lambda: np.load(tmp_path / "head.npy")}
    eager = _stage_toy(arrays, tmp_path / "eager")
    streamed = _stage_toy(lazy, tmp_path / "lazy")
    assert eager.to_json() == streamed.to_json()
    for w in eager.weights:
        assert (tmp_path / "eager" / w.file).read_bytes() == (tmp_path / "lazy" / w.file).read_bytes()


def test_a_loader_that_breaks_its_declared_shape_is_refused_by_name(tmp_path):
    class Wrong(_OnDisk):
        def load(self):
            return np.zeros((3, 3), np.float32)

    arrays = toy_weights()
    np.save(tmp_path / "mix.npy", arrays["mix"])
    with pytest.raises(ExportError, match=r"weight 'mix'.*float32\[3, 3\], declared float32\[16, 16\]"):
        _stage_toy(dict(arrays, mix=Wrong(tmp_path / "mix.npy")), tmp_path / "out")


def test_progress_off_a_terminal_is_plain_lines(monkeypatch):
    log = io.StringIO()
    bar = progress_bar(50, "export", True, stream=log)
    assert isinstance(bar, LineProgress)
    bar.interval = 0.0
    for i in range(50):
        bar.set_postfix_str(f"weights/{i:04d}_layers.gate_up_proj.0.codes")
        bar.update()
    bar.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 51
    assert lines[0].startswith("export: 1/50 (weights/0000_") and lines[-1].startswith("export: 50/50, ")
    assert max(len(line) for line in lines) < 120

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    assert not isinstance(progress_bar(5, "export", True, stream=Terminal()), LineProgress)


def test_weight_files_are_the_manifest_records(f32_checkpoint, tmp_path):
    """Each streamed weight file's size and sha256 are what the manifest says (the loader verifies them)."""
    m = export_checkpoint(f32_checkpoint, tmp_path / "a", **SMALL, weight_quant="int8")
    for w in m.weights:
        assert (tmp_path / "a" / w.file).stat().st_size == w.nbytes
        assert af.sha256_file(tmp_path / "a" / w.file) == w.sha256
