"""`python -m tlaloc_jax.tools.train`: train the small Llama-architecture model that `make demo` embeds.

The corpus is text every machine has offline: the .py files of the running Python's standard library,
so the model learns to complete Python code. A byte-level BPE tokenizer is trained on the same files
with `tokenizers`. The model is the decoder's own architecture and weight slots (tlaloc_jax.layers,
the Weights dict of tlaloc_jax.checkpoint, layers stacked [L, ...] under lax.scan), run densely over
whole windows with the training attention (tlaloc_jax.kernels.causal_attention, whose custom_vjp is
the backward that trains). The result is a Hugging Face checkpoint (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) that tlaloc_jax.load_hf and transformers both read.

Everything is seeded: the same Python standard library, seed and arguments give the same tokenizer, the
same batches and (same machine and software) the same weights. The shipped model is this CLI's defaults:
1200 steps of 8 x 256 tokens on Python 3.11's library, about 19 minutes on two shared CPU cores;
training.json beside it records the run and its losses.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import jax
import jax.numpy as jnp

from ..checkpoint import save_checkpoint
from ..config import DecoderConfig
from ..decoder import Weights
from ..dense import Attention, next_token_loss, training_attention
from ..families import Family, config_from_hf
from .demo import DEMO_MODEL as DEMO_MODEL_DIR

EOT = "<|endoftext|>"

# Folders of the standard library left out of the corpus: third-party packages, the test suites
# (mostly fixtures and data), and generated tables (codec maps, pydoc's topic strings).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings",
                           "pydoc_data", "__pycache__"})


@dataclass(frozen=True)
class TrainConfig:
    """The shape of the model and of its training run (the CLI's defaults ship as the demo model)."""

    vocab_size: int = 4096
    hidden_size: int = 192
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 32
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 1200
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    val_every: int = 20          # hold out one file in val_every (by sorted path)
    eval_interval: int = 300
    eval_batches: int = 8
    key_block: int = 256
    copy_fraction: float = 0.0   # share of training windows that quote their own start again (copying_windows)
    synthetic_copy: float = 0.0  # share of training windows of random ids repeated after `sep` (synthetic_copy_windows)
    copy_span_min: int = 16      # the length range of synthetic_copy_windows' spans
    copy_span_max: int = 96

    def hf_config(self, *, eos_id: int) -> dict[str, Any]:
        """The config.json of the trained model (a plain Llama: no biases, default RoPE, tied head)."""
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float32",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "max_position_embeddings": self.seq_len, "tie_word_embeddings": True,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "initializer_range": 0.02, "use_cache": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id,
        }


# ---------------------------------------------------------------------------------------------------
# Corpus and tokenizer

def corpus_files(stdlib: str | Path | None = None) -> list[Path]:
    """The standard library's .py files, sorted by path relative to the library (a stable order)."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_files(files: Sequence[Path], val_every: int) -> tuple[list[Path], list[Path]]:
    """-> (train, validation): every val_every-th file (by sorted position) is held out."""
    val = [f for i, f in enumerate(files) if i % val_every == val_every // 2]
    held = set(val)
    return [f for f in files if f not in held], val


def read_texts(files: Sequence[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenizer, every byte in the base alphabet) with EOT as id 0.

    The post-processor prepends EOT to every encoding, so a prompt starts as a file does in training
    (after the separator); transformers and `tokenizers` both apply it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    eot = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B",
                                                       special_tokens=[(EOT, eot)])
    return tok


def encode_corpus(tok, texts: Sequence[str]) -> np.ndarray:
    """Files joined into one stream, each preceded by EOT (the post-processor's): int32 [N]."""
    return np.concatenate([np.asarray(e.ids, np.int32) for e in tok.encode_batch(list(texts))])


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}# {{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}{{ message['content'] }}"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def write_tokenizer(out_dir: Path, tok, max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json (special tokens, a plain completion chat template)."""
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
        "bos_token": EOT, "eos_token": EOT, "pad_token": EOT, "unk_token": None,
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        # Completion model: the conversation is the text so far; an assistant turn ends at EOT.
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------------
# The model: the decoder's slots, run densely (tlaloc_jax.dense)

def init_weights(cfg: DecoderConfig, fam: Family, key: jax.Array) -> Weights:
    """Every slot of `cfg`, stacked slots [layers, ...]: norms scaling by 1, matrices N(0, 0.02), and the
    projections into the residual stream (o_proj, down_proj) scaled down by sqrt(2 L) as in GPT-2."""
    out: Weights = {}
    specs = fam.slots(cfg)
    for k, spec in zip(jax.random.split(key, len(specs)), specs):
        shape = spec.slot_shape(cfg)
        if spec.slot.endswith("norm"):
            out[spec.slot] = jnp.full(shape, 1.0 - cfg.residual.norm_offset, jnp.float32)
            continue
        std = 0.02 / math.sqrt(2 * cfg.num_layers) if spec.slot.endswith(("o_proj", "down_proj")) else 0.02
        out[spec.slot] = std * jax.random.normal(k, shape, jnp.float32)
    return out


def init_tokenizer(init: Path):
    """The tokenizer of the checkpoint to fine-tune (a retrained one could differ from it)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(init) / "tokenizer.json"))


# config.json's shape fields and the flags that set them.
SHAPE_FLAGS = {"vocab_size": "--vocab-size", "hidden_size": "--hidden-size", "intermediate_size": "--intermediate-size",
               "num_hidden_layers": "--num-layers", "num_attention_heads": "--num-heads",
               "num_key_value_heads": "--num-kv-heads", "head_dim": "--head-dim"}


def start_weights(init: Path, hf: dict[str, Any], fam: Family, cfg: DecoderConfig) -> Weights:
    """The weights of checkpoint `init`, which must have the shape the run's arguments give."""
    from ..checkpoint import load_weights, read_config

    have = read_config(init)
    for key, flag in SHAPE_FLAGS.items():
        if have.get(key) != hf[key]:
            raise ValueError(f"--init {init}: its {key} is {have.get(key)}, the run's is {hf[key]}; pass {flag} "
                             f"{have.get(key)} (fine-tuning keeps the checkpoint's shape)")
    return {k: jnp.asarray(v) for k, v in load_weights(init, fam, cfg).items()}


def make_optimizer(tc: TrainConfig):
    """AdamW (no decay on norm weights), linear warmup then cosine decay to 10%, gradients clipped at 1."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.learning_rate, tc.warmup_steps,
                                                  max(tc.steps, tc.warmup_steps + 1), tc.learning_rate * 0.1)
    decay_mask = lambda params: {k: not k.endswith("norm") for k in params}
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=decay_mask))


def loss_and_grads(cfg: DecoderConfig, weights: Weights, batch: jax.Array, *,
                   attention: Attention) -> tuple[jax.Array, Weights]:
    """The training gradient: (loss, d loss / d weights) of one batch [B, T + 1]."""
    return jax.value_and_grad(lambda w: next_token_loss(cfg, w, batch, attention=attention))(weights)


def make_train_step(cfg: DecoderConfig, optimizer, attention: Attention):
    """-> jitted (weights, opt_state, batch [B, T + 1]) -> (weights, opt_state, loss); donates both states."""
    import optax

    def step(weights, opt_state, batch):
        loss, grads = loss_and_grads(cfg, weights, batch, attention=attention)
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=4)
def _run_functions(cfg: DecoderConfig, tc: TrainConfig):
    """-> (optimizer, jitted train step, jitted loss) of a run. Memoized: a second run with the same
    configuration in one process (the reproducibility test, a notebook) reuses the compiled step."""
    optimizer = make_optimizer(tc)
    attention = training_attention(tc.key_block)
    val_loss = jax.jit(lambda w, b: next_token_loss(cfg, w, b, attention=attention))
    return optimizer, make_train_step(cfg, optimizer, attention), val_loss


def random_windows(tokens: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """batch windows of `length` consecutive tokens at uniform offsets: int32 [batch, length]."""
    starts = rng.integers(0, len(tokens) - length + 1, size=batch)
    return np.stack([tokens[s:s + length] for s in starts])


def copying_windows(windows: np.ndarray, rng: np.random.Generator, fraction: float,
                    sep: Sequence[int]) -> np.ndarray:
    """A `fraction` of the windows rewritten as a quote: the window's first m tokens (m drawn between an eighth and
    a half of the window), then `sep`, then the window from its start again for the rest, so the model learns to
    copy a text given earlier in its context and to go on with it (editing or quoting code). Others unchanged."""
    out = windows.copy()
    length = windows.shape[1]
    sep = np.asarray(sep, windows.dtype)
    for row, chosen in enumerate(rng.random(len(windows)) < fraction):
        if chosen:
            m = int(rng.integers(length // 8, (length - len(sep)) // 2 + 1))
            out[row] = np.concatenate([windows[row, :m], sep, windows[row, :length - m - len(sep)]])
    return out


def synthetic_copy_windows(rng: np.random.Generator, batch: int, length: int, ids: np.ndarray, sep: Sequence[int],
                           span: tuple[int, int]) -> np.ndarray:
    """batch windows, each one span of uniformly random `ids` (its length drawn from span = (min, max)) after `sep`,
    again and again, cut to `length`. Random ids can only be predicted by copying, and all but the first span are
    copies: the signal that forms heads which find the earlier copy of the current token (induction heads), which
    code alone does not teach a small model. -> int32 [batch, length]."""
    sep = np.asarray(sep, np.int32)
    out = np.empty((batch, length), np.int32)
    for row in range(batch):
        s = rng.choice(ids, size=int(rng.integers(span[0], span[1] + 1))).astype(np.int32)
        out[row] = np.concatenate([sep, s] * (length // (len(s) + len(sep)) + 1))[:length]
    return out


def fixed_windows(tokens: np.ndarray, count: int, length: int) -> np.ndarray:
    """Up to `count` disjoint windows spread evenly over `tokens`: int32 [count, length]."""
    n = len(tokens) // length
    idx = np.linspace(0, n - 1, num=min(count, n)).astype(np.int64)
    return np.stack([tokens[i * length:(i + 1) * length] for i in idx])


# ---------------------------------------------------------------------------------------------------
# Training run and samples

def train(tc: TrainConfig, out_dir: Path, *, stdlib: str | Path | None = None, progress: bool = True,
          log: Callable[[str], None] = print, init: Path | None = None,
          tokenizer: Path | None = None) -> dict[str, Any]:
    """Train from scratch, or fine-tune the checkpoint `init` (its tokenizer and weights, of tc's shape), and write
    the checkpoint to out_dir; -> a summary (losses, timings). `tokenizer`: a checkpoint whose tokenizer a run from
    scratch takes rather than training one."""
    from tqdm import tqdm

    t_start = time.perf_counter()
    files = corpus_files(stdlib)
    train_files, val_files = split_files(files, tc.val_every)
    train_texts, val_texts = read_texts(train_files), read_texts(val_files)
    given = init if init is not None else tokenizer
    tok = init_tokenizer(given) if given is not None else train_tokenizer(train_texts, tc.vocab_size)
    if tok.get_vocab_size() != tc.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens, the model expects {tc.vocab_size}")
    train_ids, val_ids = encode_corpus(tok, train_texts), encode_corpus(tok, val_texts)
    log(f"corpus: {len(train_files)} train files ({len(train_ids):,} tokens), {len(val_files)} validation "
        f"files ({len(val_ids):,} tokens) from {files[0].parent if files else stdlib}; "
        f"tokenizer: byte-level BPE, {tok.get_vocab_size()} tokens "
        f"({sum(map(len, train_texts)) / len(train_ids):.2f} characters per token)")

    hf = tc.hf_config(eos_id=tok.token_to_id(EOT))
    fam, cfg = config_from_hf(hf)
    weights = init_weights(cfg, fam, jax.random.key(tc.seed)) if init is None else start_weights(init, hf, fam, cfg)
    n_params = sum(int(np.prod(w.shape)) for w in weights.values())
    log(f"model: llama, {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads "
        f"({cfg.num_kv_heads} KV heads) of {cfg.head_dim}, MLP {cfg.intermediate_size}, vocab {cfg.vocab_size}, "
        f"tied head: {n_params:,} parameters")

    optimizer, step, val_loss_fn = _run_functions(cfg, tc)
    opt_state = optimizer.init(weights)
    val_batches = fixed_windows(val_ids, tc.eval_batches * tc.batch_size, tc.seq_len + 1)

    def val_loss(w):
        chunks = [val_batches[i:i + tc.batch_size] for i in range(0, len(val_batches), tc.batch_size)]
        return float(np.mean([float(val_loss_fn(w, jnp.asarray(c))) for c in chunks]))

    rng = np.random.default_rng(tc.seed)
    sep = tok.encode("\n\n").ids   # a quote starts as a new document would: EOT, a blank line
    special = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
    plain_ids = np.setdiff1d(np.arange(tc.vocab_size, dtype=np.int32), np.asarray(special, np.int32))
    history, ema = [], None
    t_train = time.perf_counter()
    bar = tqdm(range(1, tc.steps + 1), desc="train", disable=not progress, mininterval=2.0)
    for i in bar:
        windows = random_windows(train_ids, rng, tc.batch_size, tc.seq_len + 1)
        if tc.copy_fraction:
            windows = copying_windows(windows, rng, tc.copy_fraction, sep)
        if tc.synthetic_copy:
            rows = rng.random(len(windows)) < tc.synthetic_copy
            windows[rows] = synthetic_copy_windows(rng, int(rows.sum()), windows.shape[1], plain_ids, sep,
                                                   (tc.copy_span_min, tc.copy_span_max))
        batch = jnp.asarray(windows)
        weights, opt_state, loss = step(weights, opt_state, batch)
        loss = float(loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss} at step {i}")
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        entry: dict[str, Any] = {"step": i, "loss": round(loss, 4)}
        if i % tc.eval_interval == 0 or i == tc.steps:
            entry["val_loss"] = round(val_loss(weights), 4)
            (bar.write if progress else log)(
                f"step {i}: train loss {ema:.3f} (smoothed), validation loss {entry['val_loss']:.3f}")
        history.append(entry)
        bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
    bar.close()
    train_seconds = time.perf_counter() - t_train

    out_dir = Path(out_dir)
    host = {k: np.asarray(v) for k, v in weights.items()}
    save_checkpoint(out_dir, hf, host)
    write_tokenizer(out_dir, tok, tc.seq_len)
    tail = [h["loss"] for h in history[-max(1, tc.steps // 10):]]
    summary = {
        "config": asdict(tc), "init": str(init) if init is not None else None,
        "tokenizer": str(given) if given is not None else None, "parameters": n_params,
        "python": platform.python_version(), "jax": jax.__version__,
        "corpus_files": {"train": len(train_files), "validation": len(val_files)},
        "corpus_tokens": {"train": int(len(train_ids)), "validation": int(len(val_ids))},
        "tokens_seen": tc.steps * tc.batch_size * tc.seq_len,
        "train_seconds": round(train_seconds, 1), "total_seconds": round(time.perf_counter() - t_start, 1),
        "first_train_loss": history[0]["loss"], "final_train_loss": round(float(np.mean(tail)), 4),
        "final_val_loss": history[-1]["val_loss"],
        "val_history": [h for h in history if "val_loss" in h],
    }
    (out_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"trained {tc.steps} steps ({summary['tokens_seen']:,} tokens) in {train_seconds:.0f} s: "
        f"train loss {summary['final_train_loss']:.3f} (mean of the last {len(tail)} steps), "
        f"validation loss {summary['final_val_loss']:.3f}; wrote {out_dir}")
    return summary


def sample(model, prompt: Sequence[int], max_new_tokens: int, *, temperature: float, seed: int,
           stop_ids: Sequence[int] = ()) -> list[int]:
    """Temperature sampling of one prompt through the Model's paged step (prefill once, then decode)."""
    from ..serve.core.paging import RowCall, build_step_inputs, pages_for

    S = model.block_size
    pages = list(range(pages_for(len(prompt) + max_new_tokens, S)))
    pools = model.new_pools(len(pages))
    rng = np.random.default_rng(seed)
    new, start, out = list(prompt), 0, []
    for _ in range(max_new_tokens):
        inputs = build_step_inputs([RowCall(new, start, pages)], batch=1, tokens=len(new), width=len(pages),
                                   block_size=S)
        logits, pools = model.step(pools, inputs)
        z = np.asarray(logits[0], np.float64) / temperature
        p = np.exp(z - z.max())
        nxt = int(rng.choice(len(p), p=p / p.sum()))
        out.append(nxt)
        if nxt in stop_ids:
            break
        start, new = start + len(new), [nxt]
    return out


SAMPLE_PROMPTS = ("def ", "import os\n", "class Foo(", "    for i in range(")


def print_samples(checkpoint_dir: Path, prompts: Sequence[str] = SAMPLE_PROMPTS, max_new_tokens: int = 48,
                  temperature: float = 0.8, seed: int = 0) -> None:
    """Greedy completions (load_hf(...).generate) and sampled ones, decoded with the shipped tokenizer."""
    from tokenizers import Tokenizer

    from ..model import load_hf

    tok = Tokenizer.from_file(str(Path(checkpoint_dir) / "tokenizer.json"))
    model = load_hf(checkpoint_dir)
    stop = model.config.eos_token_ids
    ids = [tok.encode(p).ids for p in prompts]
    greedy = model.generate(ids, max_new_tokens=max_new_tokens, stop_token_ids=stop)
    for p, i, g in zip(prompts, ids, greedy):
        print(f"--- greedy {p!r}\n{tok.decode(i + g)}")
        s = sample(model, i, max_new_tokens, temperature=temperature, seed=seed, stop_ids=stop)
        print(f"--- temperature {temperature} {p!r}\n{tok.decode(i + s)}")


def main(argv=None) -> None:
    defaults = TrainConfig()
    ap = argparse.ArgumentParser(prog="python -m tlaloc_jax.tools.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEMO_MODEL_DIR, help="checkpoint directory (default: %(default)s)")
    for field, value in asdict(defaults).items():
        ap.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value,
                        help="(default: %(default)s)")
    ap.add_argument("--stdlib", type=Path, default=None,
                    help="the library whose .py files are the corpus (default: the running Python's)")
    ap.add_argument("--init", type=Path, default=None,
                    help="a checkpoint of the same shape to fine-tune (its tokenizer kept) rather than train anew")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a checkpoint whose tokenizer to train with rather than one trained anew (--init: its own)")
    ap.add_argument("--no-samples", action="store_true", help="skip the sample completions at the end")
    args = ap.parse_args(argv)
    tc = TrainConfig(**{f: getattr(args, f) for f in asdict(defaults)})
    train(tc, args.out, stdlib=args.stdlib, init=args.init, tokenizer=args.tokenizer)
    if not args.no_samples:
        print_samples(args.out)


if __name__ == "__main__":
    main()
