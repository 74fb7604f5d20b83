"""A Hugging Face Llama checkpoint (one file or shards, f32 or bf16) as a GGUF for llama.cpp, written one tensor at
a time: every tensor's info goes in the header first, then each tensor is read from its shard, converted (and
quantized) and written before the next is read, so the writer holds one tensor, not the model (an 8B checkpoint's
GGUF is 8-30 GB). bench/peers.py's GGUFs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def _rope_interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """A q or k projection [heads * D, E] from Hugging Face's rotate-half order to the interleaved pairs that
    llama.cpp's Llama rope (type NORM) rotates: within each head, rows (i, i + D/2) become (2i, 2i + 1)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Shards:
    """The checkpoint's tensors by name, each read alone from its safetensors file into an array of its own
    (tlaloc_jax.checkpoint.read_tensor: no mapping of the file kept, so the writer's resident set holds one tensor,
    not the pages read so far)."""

    def __init__(self, ck: Path):
        from tlaloc_jax.checkpoint import safetensors_header
        index = ck / "model.safetensors.index.json"
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
                 else ["model.safetensors"])
        self.where: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            header, start = safetensors_header(ck / name)
            self.where.update({t: (ck / name, entry, start) for t, entry in header.items()})

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name][1]["shape"])

    def f32(self, name: str) -> np.ndarray:
        from tlaloc_jax.checkpoint import read_tensor
        path, entry, start = self.where[name]
        return read_tensor(path, name, entry, start).astype(np.float32, copy=False)


def _plan(hf: dict, shards: _Shards) -> list[tuple[str, str, int, bool]]:
    """(GGUF name, checkpoint name, heads to interleave for rope or 0, is a layer projection) in writing order. A
    tied checkpoint has no head: llama.cpp then reads token_embd as the output projection."""
    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    plan = [("token_embd.weight", "model.embed_tokens.weight", 0, False),
            ("output_norm.weight", "model.norm.weight", 0, False)]
    if "lm_head.weight" in shards.where:
        plan.append(("output.weight", "lm_head.weight", 0, False))
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        proj = [(f"blk.{i}.{g}.weight", p + h + ".weight", {"attn_q": heads, "attn_k": kv}.get(g, 0), True)
                for g, h in PROJECTIONS.items()]
        # q and k, the norms, then the other projections: the order bench/peers.py wrote before it streamed.
        plan += proj[:2] + [(f"blk.{i}.{g}.weight", p + h + ".weight", 0, False) for g, h in NORMS.items()] + proj[2:]
    return plan


def _vocabulary(w, hf: dict) -> None:
    """A stand-in SentencePiece vocabulary (<unk>, <s>, </s>, 256 byte tokens, then placeholder pieces): ids are
    what the benchmark feeds and compares."""
    import gguf
    n, T = hf["vocab_size"], gguf.TokenType
    toks = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
    toks += [f"\u2581t{i}".encode() for i in range(len(toks), n)]
    types += [T.NORMAL] * (n - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(n - 259)])
    w.add_token_types(types)
    w.add_bos_token_id(hf["bos_token_id"])
    w.add_eos_token_id(hf["eos_token_id"])
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)


def write_gguf(ck: Path, hf: dict, out: Path, projections: str = "F32") -> None:
    """The checkpoint as a GGUF of llama.cpp's `llama` architecture. projections: "F32", or "Q8_0" / "Q4_0" for the
    layer projections (quantized by gguf's reference quantizer; the embedding, norms and head stay F32, as a
    tlaloc-jax quantized artifact keeps them in its weight dtype)."""
    import gguf

    shards = _Shards(ck)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_rope_dimension_count(hf["head_dim"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    w.add_vocab_size(hf["vocab_size"])
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[projections])
    _vocabulary(w, hf)
    qtype = getattr(gguf.GGMLQuantizationType, projections)
    plan = _plan(hf, shards)
    for name, src, _, proj in plan:
        shape = shards.shape(src)
        if proj and projections != "F32":
            raw = gguf.quant_shape_to_byte_shape(shape, qtype)
            w.add_tensor_info(name, raw, np.dtype(np.uint8), int(np.prod(raw)), raw_dtype=qtype)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, src, heads, proj in plan:
        a = shards.f32(src)
        if heads:
            a = _rope_interleave(a, heads)
        w.write_tensor_data(gguf.quants.quantize(a, qtype) if proj and projections != "F32" else a)
        del a
    w.close()
