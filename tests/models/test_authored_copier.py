"""bench/authored_copier.py: a tiny authored copier, run by transformers, continues a quoted sequence of random token
ids by copying it; the control, the same model with its induction head's key rows permuted, does not (the bound
must fail there, or the check could not fail). And a shape it cannot be built at is refused by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
# bench/ is no installed package: load the module from its file, whichever folder pytest runs from.
_spec = importlib.util.spec_from_file_location("authored_copier", ROOT / "bench" / "authored_copier.py")
authored = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(authored)

TINY = dict(layers=4, hidden=512, intermediate=64, heads=4, head_dim=128, context=8, max_positions=256)
VOCAB, QUOTE, RESTART, BOUND = 512, 64, 8, 0.9


def copied_share(tmp_path: Path, **options) -> float:
    """The share of the quote's remaining tokens that transformers' greedy continuation (argmax) repeats, position by
    position, of a random quote (ids 1 .. VOCAB - 1), a separator, and the quote's first RESTART ids again."""
    ck = authored.authored_copier(tmp_path / "ck", vocab=VOCAB, tokenizer_dir=None, **TINY, **options)
    quote = np.random.default_rng(1).integers(1, VOCAB, QUOTE).tolist()
    [out] = authored.greedy(ck, [quote + [VOCAB - 1] + quote[:RESTART]], QUOTE - RESTART)
    return float(np.mean([a == b for a, b in zip(out, quote[RESTART:])]))


def test_the_authored_copier_copies_a_quote(tmp_path):
    assert copied_share(tmp_path) >= BOUND


def test_control_with_its_induction_keys_permuted_it_does_not_copy(tmp_path):
    assert copied_share(tmp_path, induction_key_perm=True) < BOUND / 3


def test_a_shape_without_room_for_the_circuit_is_refused():
    with pytest.raises(ValueError, match="needs 3 layers or more"):
        authored.authored_weights(VOCAB, **{**TINY, "layers": 2})
    with pytest.raises(ValueError, match="heads x head_dim == hidden"):
        authored.authored_weights(VOCAB, **{**TINY, "hidden": 384})
