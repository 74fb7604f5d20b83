"""Training (tlaloc_jax.tools.train, tlaloc_jax.dense) and the embedded demo model it produced."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tlaloc_jax
from hf_models import load_hf_torch, torch_greedy
from margins import assert_within
from oracle import GreedyMismatch, check_greedy_batch, engine_next_token, transposed_weight
from tlaloc_jax.checkpoint import random_weights
from tlaloc_jax.dense import dense_logits, next_token_loss, training_attention
from tlaloc_jax.families import config_from_hf
from tlaloc_jax.kernels import causal_attention_reference
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.tools.train import (DEMO_MODEL_DIR, EOT, TrainConfig, copying_windows, corpus_files,
                                    loss_and_grads, random_windows, split_files, synthetic_copy_windows, train,
                                    train_tokenizer)

# Dimensions chosen apart from each other and from T (37) and its key-block padding (48), so that a
# [T, T] tensor in a jaxpr can be told from the others by its shape.
TINY = {
    "model_type": "llama", "vocab_size": 96, "hidden_size": 40, "intermediate_size": 56, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 10, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
T, KEY_BLOCK = 37, 16   # three key blocks, the last one partly padding


def tiny(seed=0, **overrides):
    fam, cfg = config_from_hf({**TINY, **overrides})
    return cfg, {k: jnp.asarray(v) for k, v in random_weights(cfg, fam, seed).items()}


def random_batch(seed, vocab, batch=2, length=T + 1):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, length)), jnp.int32)


# ---------------------------------------------------------------------------------------------------
# The dense forward is the decoder's model

GEMMA2 = {"model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4,
          "layer_types": ["sliding_attention", "full_attention"], "attn_logit_softcapping": 20.0,
          "final_logit_softcapping": 10.0, "query_pre_attn_scalar": 12}


@pytest.mark.parametrize("overrides", [{}, {"model_type": "qwen3", "tie_word_embeddings": False}, GEMMA2],
                         ids=["llama-tied", "qwen3-untied", "gemma2-sliding-softcap"])
@pytest.mark.numeric
def test_dense_forward_matches_paged_decoder(overrides):
    """Each prompt's last-token logits from the dense forward equal the paged decoder's (one batched prefill).
    Gemma 2 brings a sliding window shorter than the prompts, soft-caps, (1 + w) and sandwich norms."""
    cfg, weights = tiny(seed=1, **overrides)
    prompts = [[5, 17, 90, 3, 60, 8, 61], [42], list(range(3, 93, 3))]
    paged = tlaloc_jax.Model(cfg, weights, block_size=8).first_logits(prompts)
    attention = training_attention(KEY_BLOCK)
    bound = tol.bound(tol.decoder_roundings_of(cfg, context=max(map(len, prompts))))
    for prompt, want in zip(prompts, paged):
        got = dense_logits(cfg, weights, jnp.asarray([prompt], jnp.int32), attention=attention)[0, -1]
        assert_within(relative_error(got, want), bound, f"dense vs paged, prompt of {len(prompt)} tokens")


# ---------------------------------------------------------------------------------------------------
# The custom_vjp is what trains

@jax.jit
def _grads(weights, batch):
    cfg, _ = tiny()
    fast = loss_and_grads(cfg, weights, batch, attention=training_attention(KEY_BLOCK))
    dense = loss_and_grads(cfg, weights, batch, attention=causal_attention_reference)
    return fast, dense


@pytest.mark.numeric
def test_training_gradient_matches_reference_attention():
    """The gradient of one training batch through the blockwise custom_vjp attention equals jax.grad through
    the dense reference attention, slot by slot."""
    cfg, weights = tiny()
    batch = random_batch(0, cfg.vocab_size)
    # The loss: the decoder's path, a log-softmax over the vocabulary, the mean over the batch's tokens.
    forward = tol.decoder_roundings_of(cfg, context=T) + cfg.vocab_size + batch.size
    (loss, grads), (want_loss, want_grads) = _grads(weights, batch)
    assert_within(abs(float(loss) - float(want_loss)) / abs(float(want_loss)), tol.bound(forward), "training loss")
    assert set(grads) == set(weights)
    grad_bound = tol.bound(tol.backward_roundings(forward, batch.size))
    for name in weights:
        assert_within(relative_error(grads[name], want_grads[name]), grad_bound, f"training gradient {name}")


def test_control_noncausal_attention_gradient_differs():
    """Control: attention that also sees later tokens (a wrong mask) changes the gradient far beyond the tolerance."""
    cfg, weights = tiny()
    batch = random_batch(0, cfg.vocab_size)

    def leaky(q, k, v, *, scale, window, soft_cap):
        # Reverse time, attend causally, reverse back: token t sees t..T-1 instead of 0..t.
        flip = lambda x: x[:, ::-1]
        return flip(causal_attention_reference(flip(q), flip(k), flip(v), scale=scale))

    _, want = _grads(weights, batch)[1]
    _, wrong = jax.jit(lambda w, b: loss_and_grads(cfg, w, b, attention=leaky))(weights, batch)
    assert max(relative_error(wrong[n], want[n]) for n in weights) > 1e-2


def test_training_backward_holds_no_token_by_token_tensor(jaxpr_eqns):
    """The training gradient never holds a [T, T] tensor: its attention backward is the blockwise custom_vjp
    rule, not autodiff of a dense softmax. Control: through the reference attention it does."""
    cfg, weights = tiny()
    batch = random_batch(0, cfg.vocab_size)
    lengths = {T, -(-T // KEY_BLOCK) * KEY_BLOCK}

    def has_square(attention):
        eqns = jaxpr_eqns(lambda w: loss_and_grads(cfg, w, batch, attention=attention), weights)
        return any(sum(d in lengths for d in v.aval.shape) >= 2 for e in eqns for v in e.outvars)

    assert not has_square(training_attention(KEY_BLOCK))
    assert has_square(causal_attention_reference)


# ---------------------------------------------------------------------------------------------------
# Training from scratch

@pytest.fixture(scope="module")
def small_stdlib(tmp_path_factory):
    """A 'standard library' of the first 16 corpus files, so tokenizer and training take seconds."""
    root = tmp_path_factory.mktemp("stdlib")
    src = corpus_files()
    base = src[0].parent
    for f in src[:16]:
        dst = root / f.relative_to(base)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dst)
    return root


def test_corpus_is_sorted_and_split_without_overlap():
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    files = corpus_files()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert not [r for r in rel if r.startswith(("site-packages/", "test/", "encodings/"))]
    train_files, val_files = split_files(files, 20)
    assert val_files and not set(train_files) & set(val_files)
    assert len(train_files) + len(val_files) == len(files)


def test_tokenizer_is_reproducible_and_round_trips(small_stdlib):
    texts = [f.read_text() for f in corpus_files(small_stdlib)]
    a, b = train_tokenizer(texts, 400), train_tokenizer(texts, 400)
    assert a.to_str() == b.to_str()
    text = "def f(x):\n    return {'é': x}  # 🌮\n"
    ids = a.encode(text).ids
    assert ids[0] == a.token_to_id(EOT) == 0
    assert a.decode(ids) == text


TINY_RUN = TrainConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, seq_len=32, batch_size=8, steps=80, learning_rate=1e-2,
                       warmup_steps=5, val_every=4, eval_interval=40, eval_batches=2, key_block=32)


@pytest.fixture(scope="module")
def two_runs(small_stdlib, tmp_path_factory):
    """The same tiny training run twice (same seed): -> [(summary, checkpoint dir)] * 2."""
    runs = []
    for name in ("a", "b"):
        out = tmp_path_factory.mktemp("run") / name
        runs.append((train(TINY_RUN, out, stdlib=small_stdlib, progress=False, log=lambda s: None), out))
    return runs


def test_training_from_scratch_lowers_the_loss_and_writes_a_checkpoint(two_runs):
    summary, out = two_runs[0]
    assert summary["first_train_loss"] > math.log(TINY_RUN.vocab_size) - 0.5   # it starts untrained
    assert summary["final_train_loss"] < summary["first_train_loss"] - 1.0
    assert summary["final_val_loss"] < summary["val_history"][0]["val_loss"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    model = tlaloc_jax.load_hf(out)
    assert model.config.vocab_size == TINY_RUN.vocab_size and model.config.tie_word_embeddings


def test_same_seed_same_checkpoint(two_runs):
    """Seeded: two runs with the same arguments write the same tokenizer and the same weights."""
    (_, a), (_, b) = two_runs
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_copying_windows_quote_their_own_start():
    """--copy-fraction: a chosen window is its first m tokens (an eighth to a half of it), the separator, then its
    start again; the rest are left as drawn. Distinct token ids, so a repeat can only be a copy."""
    length, sep = 64, [-1, -2]
    drawn = random_windows(np.arange(10_000, dtype=np.int32), np.random.default_rng(0), 200, length)
    out = copying_windows(drawn, np.random.default_rng(1), 0.5, sep)
    quoted = 0
    for before, after in zip(drawn, out):
        if (after == before).all():
            continue
        quoted += 1
        m = int(np.flatnonzero(after == sep[0])[0])
        assert length // 8 <= m <= (length - len(sep)) // 2
        assert (after[:m] == before[:m]).all() and list(after[m:m + 2]) == sep
        assert (after[m + 2:] == before[:length - m - 2]).all()
    assert 70 <= quoted <= 130   # about half of 200
    assert (copying_windows(drawn, np.random.default_rng(1), 0.0, sep) == drawn).all()


def test_synthetic_copy_windows_repeat_random_spans():
    """--synthetic-copy: a window is one span of the given ids (its length in the range) after the separator, over
    and over, cut to the window's length. Spans differ between windows, and no id outside `ids` appears."""
    length, sep, ids = 300, [-1, -2], np.arange(100, 4096, dtype=np.int32)
    ids = ids[ids != 150]
    out = synthetic_copy_windows(np.random.default_rng(0), 20, length, ids, sep, (16, 40))
    assert out.shape == (20, length) and out.dtype == np.int32
    spans = set()
    for row in out:
        assert set(row.tolist()) - set(sep) <= set(ids.tolist())
        assert list(row[:2]) == sep
        m = int(np.flatnonzero(row[2:] == sep[0])[0])
        assert 16 <= m <= 40
        spans.add(tuple(row[2:2 + m].tolist()))
        unit = np.concatenate([sep, row[2:2 + m]])
        assert (row == np.resize(unit, length)).all()
    assert len(spans) == 20


def test_synthetic_copy_run_takes_the_given_tokenizer(two_runs, small_stdlib, tmp_path):
    """A run from scratch on synthetic copies with --tokenizer: the checkpoint's tokenizer is kept (none trained),
    the weights start untrained, and training.json records both."""
    _, start = two_runs[0]
    run = dataclasses.replace(TINY_RUN, steps=2, synthetic_copy=1.0, copy_span_min=4, copy_span_max=12,
                              eval_interval=2)
    got = train(run, tmp_path / "copier", stdlib=small_stdlib, progress=False, log=lambda s: None, tokenizer=start)
    assert got["first_train_loss"] > math.log(TINY_RUN.vocab_size) - 0.5
    assert got["tokenizer"] == str(start) and got["init"] is None and got["config"]["synthetic_copy"] == 1.0
    assert (tmp_path / "copier" / "tokenizer.json").read_bytes() == (start / "tokenizer.json").read_bytes()


def test_fine_tuning_starts_from_the_checkpoint(two_runs, small_stdlib, tmp_path):
    """--init: the run keeps the checkpoint's tokenizer and starts at its loss, not an untrained one's; a shape
    that differs from the checkpoint's is refused naming the flag."""
    summary, start = two_runs[0]
    tuned = dataclasses.replace(TINY_RUN, steps=2, copy_fraction=0.5, eval_interval=2)
    got = train(tuned, tmp_path / "tuned", stdlib=small_stdlib, progress=False, log=lambda s: None, init=start)
    assert got["first_train_loss"] < summary["first_train_loss"] - 1.0
    assert got["init"] == str(start) and got["config"]["copy_fraction"] == 0.5
    assert (tmp_path / "tuned" / "tokenizer.json").read_bytes() == (start / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="--hidden-size 32"):
        train(dataclasses.replace(tuned, hidden_size=48), tmp_path / "wide", stdlib=small_stdlib, progress=False,
              log=lambda s: None, init=start)


# ---------------------------------------------------------------------------------------------------
# The embedded demo model

PROMPTS = ["def ", "import os\n", "class Foo("]


@pytest.fixture(scope="module")
def demo_tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))


def test_embedded_checkpoint_is_small_and_complete():
    files = {p.name: p.stat().st_size for p in DEMO_MODEL_DIR.iterdir()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert name in files, name
    assert sum(files.values()) <= 16 * 2 ** 20
    hf = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert hf["model_type"] == "llama" and hf["tie_word_embeddings"]


@pytest.mark.numeric
def test_embedded_checkpoint_greedy_ids_match_transformers(demo_tokenizer):
    """transformers' LlamaForCausalLM and load_hf(...).generate give the same greedy ids for three prompts, up
    to the near-ties the tolerance model allows. Control: the model with a transposed projection fails."""
    prompts = [demo_tokenizer.encode(p).ids for p in PROMPTS]
    ref = load_hf_torch(DEMO_MODEL_DIR)
    assert type(ref).__name__ == "LlamaForCausalLM"
    model = tlaloc_jax.load_hf(DEMO_MODEL_DIR)
    want = [torch_greedy(ref, p, 16) for p in prompts]
    bound = tol.bound(tol.decoder_roundings_of(model.config, context=max(map(len, prompts)) + 16))
    check_greedy_batch(prompts, model.generate(prompts, max_new_tokens=16), want, logit_bound=bound,
                       next_token=engine_next_token(model))
    broken = transposed_weight(model)
    with pytest.raises(GreedyMismatch):
        check_greedy_batch(prompts, broken.generate(prompts, max_new_tokens=16), want, logit_bound=bound,
                           next_token=engine_next_token(broken))


def test_transformers_tokenizer_matches_tokenizers(demo_tokenizer):
    """AutoTokenizer reads tokenizer.json + tokenizer_config.json: same ids (EOT first), EOT as bos/eos."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    for text in PROMPTS + ["    for i in range(10):\n        print(i)\n"]:
        assert tok(text).input_ids == demo_tokenizer.encode(text).ids
    assert tok.bos_token == tok.eos_token == EOT and tok.eos_token_id == 0


def test_embedded_model_predicts_held_out_stdlib_code(demo_tokenizer):
    """The shipped model is trained: on held-out standard-library files its next-token loss is far below the
    entropy of those very tokens' own frequencies (what a model of token counts alone could reach; measured
    3.6 against 5.4). Control: the same tokens shuffled score worse than that entropy (measured 8.8)."""
    model = tlaloc_jax.load_hf(DEMO_MODEL_DIR)
    _, val_files = split_files(corpus_files(), 20)
    ids = np.concatenate([demo_tokenizer.encode(f.read_text()).ids for f in val_files[:4]])
    n = 257
    batch = np.stack([ids[i * n:(i + 1) * n] for i in range(4)]).astype(np.int32)
    counts = np.bincount(batch[:, 1:].ravel())
    p = counts[counts > 0] / counts.sum()
    unigram_entropy = float(-(p * np.log(p)).sum())
    shuffled = np.random.default_rng(0).permutation(batch.reshape(-1)).reshape(batch.shape)
    loss = jax.jit(lambda w, b: next_token_loss(model.config, w, b, attention=training_attention(256)))
    assert float(loss(model.weights, jnp.asarray(batch))) < unigram_entropy - 1.0
    assert float(loss(model.weights, jnp.asarray(shuffled))) > unigram_entropy
