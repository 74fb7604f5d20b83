"""An authored copier: a Hugging Face Llama checkpoint whose weights are set by hand, not trained, so that its greedy
continuation of a quoted excerpt copies it (what bench/speculative.py's copy-heavy workload wants of a target, as
real language models copy quoted text). It is an induction circuit (Olsson et al., "In-context learning and
induction heads") in 4 layers, padded with filler layers to a weight-bound size (10 layers, ~133M parameters, by
default): not a trained model, and it models no language (open generation loops on what it was given).

- The residual stream: the token's code (a random unit vector, seeded; its first block, of half its squared norm,
  is what the induction head matches on), the first block of the codes of the `context` tokens before it (written
  by the shift heads), and one constant dimension that every embedding carries.
- Shift heads (layers 0 .. 2 at context 16): q and k from the constant dimension only, in the RoPE pairs that turn,
  so that the score is sum_p a_p cos(theta_p (i - j - s)), which peaks at key j = i - s; the amplitudes a_p are a
  linear program's that maximise that peak's margin over every other distance. Layer 0's heads copy the token
  1 .. 4 back, each further layer's one head the blocks so far 4, 8, .. further back.
- The induction head: query (the token 0 .. context - 1 back) against key (1 .. context back), in RoPE pairs that
  barely turn over max_positions (a large rope_theta), weighted from 1 down to 0.4, so that the longest match ending
  at the current token wins, as n-gram lookup's longest match does; V reads the code at the key (the token that
  followed there) and O adds it to the code with a large gain, which the tied head (logits = final_norm(x) . E)
  reads as the next token.
- Filler layers after the circuit: random q, k, v, gate and up projections and tiny o_proj and down_proj
  (filler_std), so that a step reads a real model's bytes without disturbing the copy. The circuit's MLPs are zero.

    python -m bench.authored_copier OUT [--layers 10] [--hidden 1024] [--intermediate 2816] [--check]

--check runs transformers' greedy generation on bench/speculative.py's prompts and prints the copied fraction.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "tlaloc_jax" / "demo_model"
POSITION_NATS = 40.0   # shift heads: the score's margin at the distance wanted over every other distance
MATCH_NATS = 60.0      # induction head: the current token matched scores this; the one `context - 1` back 0.4 of it
COPY_GAIN = 10.0       # induction head's output: the copied code's norm against the current token's (1)
MATCHED = 0.5          # the share of a code's squared norm in its first block, the one the induction head matches on


def rope_split(head_dim: int, rope_theta: float, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (RoPE's per-pair angles, the content pairs: those turning at most 0.2 rad over max_positions)."""
    theta = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return theta, np.flatnonzero(theta * max_positions <= 0.2)


def shift_amplitudes(theta: np.ndarray, max_positions: int) -> np.ndarray:
    """Amplitudes a_p >= 0 of the pairs given, maximising the least of sum_p a_p (1 - cos(theta_p d)) over the
    distances d = 1 .. max_positions (the peak's margin at d = 0; a linear program), scaled so that it is 1."""
    from scipy.optimize import linprog

    d = np.arange(1, max_positions + 1)
    n = len(theta)
    gaps = 1 - np.cos(np.outer(d, theta))
    res = linprog(np.r_[np.zeros(n), -1.0], A_ub=np.hstack([-gaps, np.ones((len(d), 1))]), b_ub=np.zeros(len(d)),
                  A_eq=np.r_[np.ones(n), 0.0][None], b_eq=[1.0], bounds=[(0, None)] * n + [(None, None)])
    if res.status != 0 or -res.fun < 0.05:
        raise ValueError(f"no previous-token pattern from {n} RoPE pairs over {max_positions} positions "
                         f"(margin {-res.fun:.3f}): use a larger head_dim or fewer positions")
    return res.x[:n] / -res.fun


def token_codes(vocab: int, dims: int, block: int, rng) -> np.ndarray:
    """-> vocab x dims codes of norm 1, random directions: the first `block` dims of norm sqrt(MATCHED), the rest
    the remainder (so that a code matches itself by the same score, whichever token)."""
    codes = rng.standard_normal((vocab, dims))
    for part, share in ((slice(0, block), MATCHED), (slice(block, dims), 1 - MATCHED)):
        codes[:, part] *= np.sqrt(share) / np.linalg.norm(codes[:, part], axis=1, keepdims=True)
    return codes


def authored_weights(vocab: int, *, layers: int = 10, hidden: int = 1024, intermediate: int = 2816, heads: int = 4,
                     head_dim: int = 256, context: int = 16, rope_theta: float = 1e20, max_positions: int = 1024,
                     filler_std: float = 1e-3, seed: int = 0, induction_key_perm: bool = False,
                     ) -> tuple[dict, dict[str, np.ndarray]]:
    """-> (the Llama config, its weights): the induction head matches the last `context` tokens. induction_key_perm:
    the control, the induction head's key rows permuted (it must not copy)."""
    rng = np.random.default_rng(seed)
    theta, content = rope_split(head_dim, rope_theta, max_positions)
    half = head_dim // 2
    positional = np.arange(content[0] if len(content) else half)   # the pairs that turn: the shift heads' scores
    content = np.r_[content, content + half]                         # both dims of each pair that barely turns
    block = len(content) // max(context, 1)
    code = hidden - context * block - 1
    shifts = 1 + int(np.ceil(np.log2(context / min(heads, context)))) if context > 0 else 1   # shift layers
    if layers < shifts + 1 or context < 2 or heads * head_dim != hidden or block < 8 or code < 2 * block:
        raise ValueError(f"no authored copier of {layers} layers, {heads} heads of {head_dim} (hidden {hidden}), "
                         f"matching {context} tokens: it needs {shifts + 1} layers or more, context >= 2, heads x "
                         f"head_dim == hidden, a code block of 8 or more dims ({block}: {len(content)} RoPE dims "
                         f"barely turn over {max_positions} positions at rope_theta {rope_theta:g}) and a code of "
                         f"twice that or more ({code})")
    # The residual: the token's code, then the first block of the codes of the `context` tokens before it (P[k]: k
    # back; P[0] is that block of the token's own code), then a constant dimension.
    P = [slice(0, block)] + [slice(code + (k - 1) * block, code + k * block) for k in range(1, context + 1)]
    C = hidden - 1
    embed = np.zeros((vocab, hidden))
    embed[:, :code], embed[:, C] = token_codes(vocab, code, block, rng), 1.0
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": embed, "model.norm.weight": np.ones(hidden)}

    def layer(i: int, attn: dict, mlp: dict | None = None) -> None:
        p = f"model.layers.{i}."
        for n, m in attn.items():
            w[p + f"self_attn.{n}.weight"] = m
        mlp = mlp or {"gate_proj": np.zeros((intermediate, hidden)), "up_proj": np.zeros((intermediate, hidden)),
                      "down_proj": np.zeros((hidden, intermediate))}
        for n, m in mlp.items():
            w[p + f"mlp.{n}.weight"] = m
        w[p + "input_layernorm.weight"] = np.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = np.ones(hidden)

    def rms(filled: int) -> float:
        """What the RMS norm multiplies the residual by: the code (1), `filled` blocks (MATCHED each), the constant."""
        return np.sqrt(hidden / (2 + filled * MATCHED))

    # Shift heads: q and k from the constant dimension only, in the pairs that turn; pair p is dims (p, p + half),
    # its score Re(zq conj(zk) e^{i (i - j) theta_p}) / sqrt(head_dim), and zk = zq e^{i s theta_p} peaks at j = i - s.
    amp = shift_amplitudes(theta[positional], max_positions) * POSITION_NATS * np.sqrt(head_dim)

    def shift_head(attn: dict, h: int, s: int, norm: float, src: list[slice], dst: list[slice]) -> None:
        rows, zk = h * head_dim, np.sqrt(amp) * np.exp(1j * s * theta[positional])
        attn["q_proj"][rows + positional, C] = np.sqrt(amp) / norm
        attn["k_proj"][rows + positional, C] = zk.real / norm
        attn["k_proj"][rows + half + positional, C] = zk.imag / norm
        for n, (a, b) in enumerate(zip(src, dst)):   # V reads the blocks at j, O writes them s further back at i
            attn["v_proj"][rows + n * block + np.arange(block), np.arange(a.start, a.stop)] = 1.0
            attn["o_proj"][np.arange(b.start, b.stop), rows + n * block + np.arange(block)] = 1.0 / norm

    def zeros() -> dict:
        return {n: np.zeros((hidden, hidden)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}

    attn, filled = zeros(), min(heads, context)      # layer 0: heads 0.. copy the token 1, 2, .. back
    for s in range(1, filled + 1):
        shift_head(attn, s - 1, s, rms(0), [P[0]], [P[s]])
    layer(0, attn)
    i = 1
    while filled < context:                          # then one head copies the blocks so far `filled` further back
        m, attn = min(filled, context - filled), zeros()
        shift_head(attn, 0, filled, rms(filled), P[1:m + 1], P[filled + 1:filled + m + 1])
        layer(i, attn)
        i, filled = i + 1, filled + m
    # Induction head (head 0): query dims read the blocks of the tokens 0 .. context - 1 back (P[k]) and key dims
    # those 1 .. context back, one block each; weight[k] x MATCH_NATS where the token k back matches, so the longest
    # match with the current token wins. V reads the code at the key (the token that followed), O adds it to the code.
    norm, weight, attn = rms(context), np.linspace(1.0, 0.4, context), zeros()
    for k in range(context):
        g = np.sqrt(weight[k] * MATCH_NATS * np.sqrt(head_dim) / MATCHED) / norm
        dims = content[k * block:(k + 1) * block]
        attn["q_proj"][dims, np.arange(P[k].start, P[k].stop)] = g
        attn["k_proj"][dims, np.arange(P[k + 1].start, P[k + 1].stop)] = g
    attn["v_proj"][np.arange(code), np.arange(code)] = 1.0
    attn["o_proj"][np.arange(code), np.arange(code)] = COPY_GAIN / norm
    if induction_key_perm:
        attn["k_proj"] = attn["k_proj"][rng.permutation(hidden)]
    layer(i, attn)
    for i in range(i + 1, layers):   # filler: a real layer's bytes, its outputs tiny
        layer(i, {**{n: rng.normal(0, 0.02, (hidden, hidden)) for n in ("q_proj", "k_proj", "v_proj")},
                  "o_proj": rng.normal(0, filler_std, (hidden, hidden))},
              {"gate_proj": rng.normal(0, 0.02, (intermediate, hidden)),
               "up_proj": rng.normal(0, 0.02, (intermediate, hidden)),
               "down_proj": rng.normal(0, filler_std, (hidden, intermediate))})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
              "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "dtype": "float32",
              "head_dim": head_dim, "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02,
              "intermediate_size": intermediate, "max_position_embeddings": max_positions, "mlp_bias": False,
              "num_attention_heads": heads, "num_hidden_layers": layers, "num_key_value_heads": heads,
              "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
              "tie_word_embeddings": True, "use_cache": True, "vocab_size": vocab}
    return config, {k: v.astype(np.float32) for k, v in w.items()}


def authored_copier(out: Path, vocab: int = 4096, tokenizer_dir: Path | None = DEMO, **options) -> Path:
    """Writes the checkpoint (config.json, model.safetensors, the tokenizer's files if any) into `out` -> out."""
    from safetensors.numpy import save_file

    config, weights = authored_weights(vocab, **options)
    out.mkdir(parents=True, exist_ok=True)
    config["authored"] = "an induction circuit set by hand (bench/authored_copier.py), not a trained model: " \
        + json.dumps(options, sort_keys=True)
    save_file(weights, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer_dir else ():
        shutil.copy(tokenizer_dir / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=2))   # last: a written checkpoint has it
    return out


def greedy(ckpt: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy continuations of the prompts, `new` tokens each, by argmax of its forward pass (no
    generate(): its end-of-text handling is not Engine.generate's, which stops for no token)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = model(torch.tensor([p]), use_cache=True)
            ids = [int(out.logits[0, -1].argmax())]
            while len(ids) < new:
                out = model(torch.tensor([ids[-1:]]), cache=out.cache, use_cache=True)
                ids.append(int(out.logits[0, -1].argmax()))
            outs.append(ids)
    return outs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="greedy-generate with transformers on the bench's prompts")
    ap.add_argument("--export", type=Path, default=None,
                    help="with --check: also export it there (--speculative-tokens 4) and check that this runtime's "
                         "greedy ids equal transformers' on the copy-heavy prompts")
    a = ap.parse_args(argv)
    ck = authored_copier(a.out, layers=a.layers, hidden=a.hidden, intermediate=a.intermediate, seed=a.seed)
    print(f"wrote {ck}")
    if a.check:
        from tokenizers import Tokenizer

        from bench.speculative import RESTART, copied, workloads
        tok = Tokenizer.from_file(str(ck / "tokenizer.json"))
        loads = workloads(tok, 96)
        outs = greedy(ck, loads["copy-heavy"], 96)
        got = copied(loads["copy-heavy"], outs, 96)
        print(f"copy-heavy: continuations repeat {got} of the {96 - RESTART} quoted tokens left "
              f"({sum(got) / (len(got) * (96 - RESTART)):.0%})")
        for p, o in zip(loads["open"], greedy(ck, loads["open"], 24)):
            print(f"open: {tok.decode(p)!r} -> {tok.decode(o)!r}")
        if a.export:
            from tlaloc_jax.export import export_checkpoint
            from tlaloc_jax.serve import Engine

            export_checkpoint(ck, a.export, batch_ladder=(1, 4), context_ladder=(256,), speculative_tokens=4,
                              progress=False)
            with Engine.load(a.export, progress=False) as eng:
                ours = eng.generate(loads["copy-heavy"], 96)
            print(f"this runtime's greedy ids ({[len(u) for u in ours]} tokens) "
                  f"{'equal' if ours == outs else 'DIFFER FROM'} transformers' ({[len(u) for u in outs]})")


if __name__ == "__main__":
    main()
