"""A tiny byte-level BPE tokenizer built with the `tokenizers` library (no downloads), for tests that need text.

Ids 0..255 are the 256 bytes (id b is byte b, in GPT-2's printable byte alphabet), a few merges follow,
and the special tokens sit at fixed ids below VOCAB. Characters outside the merges are one token per
UTF-8 byte, so "é" is one merged token while "ö" and "🌮" span two and four tokens: streaming
detokenization must hold their first bytes back.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

VOCAB = 288            # the model's vocab_size: every tokenizer id is below it
SPECIAL = {"<s>": 280, "</s>": 281, "<|im_start|>": 282, "<|im_end|>": 283, "<image>": 284}
BOS, EOS, IMAGE = SPECIAL["<s>"], SPECIAL["<|im_end|>"], SPECIAL["<image>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ã", "©"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n")]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer() -> Tokenizer:
    chars = _bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    vocab.update(SPECIAL)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS)])
    assert all(tok.token_to_id(t) == i for t, i in SPECIAL.items())
    return tok


def write_tokenizer(checkpoint_dir: Path, chat_template: bool = True) -> Path:
    """Put tokenizer.json and tokenizer_config.json (with the chat template) into a checkpoint directory."""
    checkpoint_dir = Path(checkpoint_dir)
    build_tokenizer().save(str(checkpoint_dir / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast",
              "model_max_length": 4096}
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    (checkpoint_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return checkpoint_dir
