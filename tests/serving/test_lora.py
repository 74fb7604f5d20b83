"""LoRA adapters in an artifact's slots (export max_loras): greedy ids with an adapter are transformers' on the
checkpoint with that adapter merged (W + scale B A, f32; near-tie rule, tests/support/oracle.py) for llama, qwen3
and qwen3_5 (its gated query and linear-attention projections too), alone and in one batch with base rows and
another adapter's rows; a control that swaps two rows' slots must fail. Adapters loaded, unloaded and replaced
while requests run: none is lost, each runs with the adapter it picked, and no slot stays held. PEFT adapters the
slots cannot hold, and manifests whose lora inputs disagree with their record, are refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hf_models import build_checkpoint, load_hf_torch, torch_greedy
from lora_adapters import ATTENTION, LINEAR, MLP, merged_model, write_peft
from oracle import GreedyMismatch, check_greedy_batch
from tlaloc_jax import artifact as af
from tlaloc_jax.checkpoint import load_checkpoint
from tlaloc_jax.kernels import tolerances as tol

pytestmark = pytest.mark.numeric

PROMPTS = [[(i * 37 + 11) % 256 for i in range(30)], [5, 17, 99, 3, 249, 8, 61], [42]]
NEW = 8
RANK = 4


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_5_text"])
def served(request, tmp_path_factory):
    """A checkpoint, three adapters (a2 of rank 2 < RANK with rsLoRA scaling), an artifact of 2 slots, and the
    oracles' ids per adapter (None: the base model). Qwen3.5's adapters also take its gated q_proj (query and gate
    halves) and the Gated DeltaNet layers' projections, which only some layers have."""
    from tlaloc_jax.export import export_checkpoint
    root = tmp_path_factory.mktemp(request.param)
    ck = build_checkpoint(root / "ck", request.param, seed=61)
    every = ATTENTION + MLP + (LINEAR if request.param == "qwen3_5_text" else ())
    adapters = {"a1": write_peft(root / "a1", ck, seed=1, rank=RANK, alpha=8, targets=every),
                "a2": write_peft(root / "a2", ck, seed=2, rank=2, alpha=4, use_rslora=True, targets=every),
                "a3": write_peft(root / "a3", ck, seed=3, rank=RANK, alpha=4, targets=("q_proj", "v_proj"))}
    art = root / "art"
    export_checkpoint(ck, art, batch_ladder=(1, 4), context_ladder=(64,), block_size=8, prefill_chunk=16,
                      prefill_long_chunk=0, progress=False, max_loras=2, max_lora_rank=RANK)
    # The oracle merges each adapter as the slots hold it (bf16 by default: tests/ops/test_lora_delta.py bounds
    # that rounding against f32 adapters).
    dtype = af.load_manifest(art, verify_weights=False).lora.dtype
    models = {None: load_hf_torch(ck), **{n: merged_model(ck, p, dtype) for n, p in adapters.items()}}
    oracles = {n: [torch_greedy(model, p, NEW) for p in PROMPTS] for n, model in models.items()}
    cfg = load_checkpoint(ck)[0]
    bound = tol.bound(tol.decoder_roundings_of(cfg, context=64) + tol.lora_roundings(cfg, RANK))
    return dict(ck=ck, art=art, adapters={n: str(p) for n, p in adapters.items()}, oracles=oracles, bound=bound,
                dtype=dtype)


def _engine(served, cache, **adapters):
    from tlaloc_jax.serve import Engine
    return Engine(served["art"], progress=False, cache_dir=cache, lora_modules=adapters)


def _check(eng, served, names, prompts_of, got):
    """Each output against its adapter's oracle, teacher-forced through the same adapter."""
    for name, i, ids in zip(names, prompts_of, got):
        check_greedy_batch([PROMPTS[i]], [ids], [served["oracles"][name][i]], logit_bound=served["bound"],
                           next_token=lambda ids, name=name: eng.generate([ids], 1, lora=name)[0][0])


def test_adapter_ids_equal_the_merged_checkpoint(served, serve_cache_dir):
    """Each adapter alone, then base rows, a1 rows and a2 rows in one batch (more rows than the largest call)."""
    with _engine(served, serve_cache_dir, a1=served["adapters"]["a1"], a2=served["adapters"]["a2"]) as eng:
        for name in (None, "a1", "a2"):
            _check(eng, served, [name] * 3, range(3), eng.generate(PROMPTS, NEW, lora=name))
        # The adapters change the ids: the check above is not the base model's run three times.
        assert served["oracles"]["a1"][0].ids != served["oracles"][None][0].ids
        assert served["oracles"]["a2"][1].ids != served["oracles"][None][1].ids
        names = [None, "a1", "a2", "a2", "a1", None]
        idx = [0, 0, 0, 1, 1, 1]
        _check(eng, served, names, idx, eng.generate([PROMPTS[i] for i in idx], NEW, lora=names))
        assert eng.lora.held == 0


@pytest.mark.slow
def test_the_stacked_layout_reads_the_same_adapters(served, serve_cache_dir, tmp_path):
    """Weights stacked over layers (scanned): each layer's adapter buffers are stacked in the body and indexed by the
    scan's counter; the ids are still the merged checkpoints'."""
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.serve import Engine
    art = tmp_path / "stacked"
    export_checkpoint(served["ck"], art, batch_ladder=(4,), context_ladder=(64,), block_size=8, prefill_chunk=16,
                      prefill_long_chunk=0, progress=False, max_loras=2, max_lora_rank=RANK, weight_layout="stacked")
    names = [None, "a1", "a2"]
    with Engine(art, progress=False, cache_dir=serve_cache_dir,
                lora_modules={n: served["adapters"][n] for n in ("a1", "a2")}) as eng:
        _check(eng, served, names, [0, 1, 2], eng.generate(PROMPTS, NEW, lora=names))


def test_swapped_slots_are_caught(served, serve_cache_dir, monkeypatch):
    """Control: the rows' adapter slots handed to the body in reverse row order; the same check must fail."""
    from tlaloc_jax.serve.core import inputs as call_inputs
    original = call_inputs.step_inputs

    def swapped(call, m, ring_pages):
        out = original(call, m, ring_pages)
        slots = out[af.Role.LORA_SLOTS]
        rows = list(call.out_rows)
        values = [int(slots[b]) for b in rows]
        for b, v in zip(rows, reversed(values)):
            slots[b] = v
        return out

    with _engine(served, serve_cache_dir, a1=served["adapters"]["a1"], a2=served["adapters"]["a2"]) as eng:
        names = ["a1", "a2"]
        got = eng.generate([PROMPTS[0], PROMPTS[0]], NEW, lora=names)
        _check(eng, served, names, [0, 0], got)
        monkeypatch.setattr(call_inputs, "step_inputs", swapped)
        got = eng.generate([PROMPTS[0], PROMPTS[0]], NEW, lora=names)
        with pytest.raises(GreedyMismatch):
            # Teacher forcing runs one row a call, where the swap changes nothing: compare the ids as they came.
            check_greedy_batch([PROMPTS[0]] * 2, got, [served["oracles"][n][0] for n in names],
                               logit_bound=served["bound"], next_token=lambda ids: -1)


def test_adapters_come_and_go_while_requests_run(served, serve_cache_dir):
    """a1's request runs while a1 is unloaded and its name given to a3; a3's request waits for a slot (both held)
    and then runs with a3; nothing is lost and every slot is given back."""
    from tlaloc_jax.serve.core.request import RequestRefused
    paths = served["adapters"]
    with _engine(served, serve_cache_dir, a1=paths["a1"]) as eng:
        r1 = eng.add_request(PROMPTS[0], NEW, lora="a1")
        r0 = eng.add_request(PROMPTS[1], NEW)
        eng.step()
        eng.load_lora_adapter("a2", paths["a2"])
        r2 = eng.add_request(PROMPTS[1], NEW, lora="a2")
        eng.step()
        eng.unload_lora_adapter("a1")
        with pytest.raises(RequestRefused, match="'a1' is not loaded"):
            eng.add_request(PROMPTS[2], NEW, lora="a1")
        eng.load_lora_adapter("a1", paths["a3"])          # the name now serves another adapter
        r3 = eng.add_request(PROMPTS[2], NEW, lora="a1")
        eng.step()
        assert not eng.request_info(r3).running and not eng.request_info(r1).finished   # both slots are held
        while eng.has_unfinished():
            eng.step()
        got = {r: eng.output(r) for r in (r0, r1, r2, r3)}
        assert all(eng.request_info(r).finish_reason == "length" for r in got)
        assert eng.lora.held == 0 and eng.lora.stats["slot_writes"] == 3
        for r in got:
            eng.release(r)
        eng.load_lora_adapter("a1-before", paths["a1"])   # for teacher forcing r1 with the adapter it ran with
        _check(eng, served, [None], [1], [got[r0]])
        check_greedy_batch([PROMPTS[0]], [got[r1]], [served["oracles"]["a1"][0]], logit_bound=served["bound"],
                           next_token=lambda ids: eng.generate([ids], 1, lora="a1-before")[0][0])
        _check(eng, served, ["a2"], [1], [got[r2]])
        check_greedy_batch([PROMPTS[2]], [got[r3]], [served["oracles"]["a3"][2]], logit_bound=served["bound"],
                           next_token=lambda ids: eng.generate([ids], 1, lora="a1")[0][0])


@pytest.mark.parametrize("config, match", [
    (dict(use_dora=True), "use_dora True"),
    (dict(fan_in_fan_out=True), "fan_in_fan_out True"),
    (dict(bias="lora_only"), "bias 'lora_only'"),
    (dict(rank=RANK + 1), f"rank {RANK + 1}, past the artifact's max_lora_rank {RANK}"),
    (dict(targets=("q_proj", "embed_tokens")), r"targets \['embed_tokens'\], which the artifact did not stage"),
])
def test_adapters_the_slots_cannot_hold_are_refused(served, tmp_path, config, match):
    from tlaloc_jax.serve.lora_slots import LoraError, read_peft
    shape = af.load_manifest(served["art"], verify_weights=False).lora
    config = dict(config)           # the parameter is shared by both families
    kw = dict(rank=config.pop("rank", 2))
    if "targets" in config:
        path = tmp_path / "bad"
        write_peft(path, served["ck"], seed=5, alpha=2, targets=("q_proj",), **kw)
        body = json.loads((path / "adapter_config.json").read_text())
        body["target_modules"] = list(config["targets"])
        (path / "adapter_config.json").write_text(json.dumps(body))
    else:
        path = write_peft(tmp_path / "bad", served["ck"], seed=5, alpha=2, **kw, **config)
    with pytest.raises(LoraError, match=match):
        read_peft(path, shape, "bad")


def test_an_adapter_on_a_projection_not_staged_is_refused(served, tmp_path):
    """Slots staged on q_proj and v_proj only: an adapter with k_proj tensors is refused by the module's name."""
    from tlaloc_jax.serve.lora_slots import LoraError, read_peft
    shape = af.load_manifest(served["art"], verify_weights=False).lora
    narrow = dataclasses.replace(shape, targets=tuple(t for t in shape.targets if t.name in ("q_proj", "v_proj")))
    path = write_peft(tmp_path / "k", served["ck"], seed=5, rank=2, alpha=2, targets=("q_proj", "k_proj"))
    with pytest.raises(LoraError, match="targets \\['k_proj'\\], which the artifact did not stage"):
        read_peft(path, narrow, "k")


def _manifest_json(served) -> dict:
    return json.loads((served["art"] / af.MANIFEST_NAME).read_text())


@pytest.mark.parametrize("edit, match", [
    ("drop_target_input", r"takes the lora inputs wrongly \(missing \['LORA_B down_proj.2'\]"),
    ("rank", r"LORA_A q_proj.0 is {dtype}\[3, 4, 64\], the lora record's is {dtype}\[3, 5, 64\]"),
    ("no_record", "has LORA_SLOTS, but the manifest has no lora record"),
    ("no_targets", r"lora.targets \[\] must be one or more distinct names"),
])
def test_a_manifest_whose_lora_inputs_disagree_is_refused(served, edit, match):
    raw = _manifest_json(served)
    assert raw["lora"]["max_loras"] == 2 and raw["lora"]["max_rank"] == RANK
    if edit == "drop_target_input":
        e = raw["entries"][0]
        e["inputs"] = [s for s in e["inputs"] if not (s["role"] == "LORA_B" and s["slot"] == "down_proj.2")]
    elif edit == "rank":
        raw["lora"]["max_rank"] = RANK + 1
    elif edit == "no_record":
        del raw["lora"]
    else:
        raw["lora"]["targets"] = []
    with pytest.raises(af.ManifestError, match=match.replace("{dtype}", served["dtype"])):
        af.check_manifest(af.Manifest.from_json(json.dumps(raw)))


def test_an_unknown_adapter_is_refused_by_name(served, serve_cache_dir):
    from tlaloc_jax.serve.core.request import RequestRefused
    with _engine(served, serve_cache_dir) as eng:
        with pytest.raises(RequestRefused, match="LoRA adapter 'nope' is not loaded"):
            eng.add_request(PROMPTS[0], 2, lora="nope")


def test_adapters_with_speculative_tokens_are_refused_by_name(served, tmp_path):
    """Verify entries do not take adapter slots yet: asking for both is refused at export, naming both options."""
    from tlaloc_jax.export import ExportError, export_checkpoint
    with pytest.raises(ExportError, match="lora adapters with speculative_tokens.*--max-loras or --speculative-tokens"):
        export_checkpoint(served["ck"], tmp_path / "both", batch_ladder=(1,), context_ladder=(64,), block_size=8,
                          prefill_chunk=16, prefill_long_chunk=0, progress=False, max_loras=2, max_lora_rank=RANK,
                          speculative_tokens=2)
    assert not (tmp_path / "both" / af.MANIFEST_NAME).exists()


@pytest.mark.parametrize("family, targets, match", [
    ("deepseek_v3", None, "deepseek_v3 has latent attention"),
    ("qwen3_next", None, "qwen3_next has interleaved linear-attention projections"),
    ("qwen3_moe", ("q_proj", "gate_proj"), "qwen3_moe has mixture-of-experts MLPs"),
    ("llama", ("q_proj", "in_proj_qkv"), r"\['in_proj_qkv'\] name projections llama has in no layer"),
])
def test_projections_without_an_adapter_form_are_refused_by_name(tmp_path, family, targets, match):
    from tlaloc_jax.config import ConfigError
    from tlaloc_jax.lora import decoder_lora
    cfg = load_checkpoint(build_checkpoint(tmp_path / "ck", family, seed=1))[0]
    with pytest.raises(ConfigError, match=match):
        decoder_lora(cfg, 2, RANK, targets)


def test_qwen3_5_stages_each_projection_on_the_layers_that_have_it(tmp_path):
    """Default targets: every projection the model has; the attention ones on its full-attention layers only, the
    Gated DeltaNet ones on its linear layers, the MLP ones on all; the gated q_proj twice the query's width."""
    from tlaloc_jax.lora import DECODER_TARGETS, decoder_lora
    cfg = load_checkpoint(build_checkpoint(tmp_path / "ck", "qwen3_5_text", seed=1))[0]
    record = decoder_lora(cfg, 2, RANK).record()
    layers = {t.name: t.layer_ids for t in record.targets}
    assert set(layers) == set(DECODER_TARGETS)
    assert layers["q_proj"] == (3, 7) and layers["in_proj_qkv"] == (0, 1, 2, 4, 5, 6)
    assert layers["down_proj"] == tuple(range(8)) and record.target("down_proj").model_layers == ()
    assert record.target("q_proj").outputs == 2 * cfg.num_heads * cfg.head_dim
