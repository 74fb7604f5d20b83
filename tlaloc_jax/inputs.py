"""StepInputs: the integer inputs of one call of a staged step function, named by their manifest roles.

A step function (`tlaloc_jax.stage`) receives the roles its declared pools need and None for the others:
every call has token ids, positions and sequence lengths; a paged KV pool adds the block tables and the
slot mapping, a ring KV pool the window tables and window slot mapping, a state pool the state slots.
docs/glossary.md names the dimensions.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class StepInputs(NamedTuple):
    token_ids: Any                 # TOKEN_IDS    [B, T] int32, rows right-aligned (padding first, id 0)
    positions: Any                 # POSITIONS    [B, T] int32, -1 = padding
    block_tables: Any = None       # BLOCK_TABLES [B, M] int32: page of each logical block (paged_kv)
    seq_lens: Any = None           # SEQ_LENS     [B] int32: keys written after this call; 0 = an empty row
    slot_mapping: Any = None       # SLOT_MAPPING [B, T] int32: page * S + offset of each token; -1 = write nothing
    # ring_kv: WINDOW_BLOCK_TABLES [B, R] (entry b: ring page b, R = the ring's pages, at most M) and
    # WINDOW_SLOT_MAPPING [B, T].
    window_block_tables: Any = None
    window_slot_mapping: Any = None
    # state_slots: STATE_SLOTS [B], the row's slot in the state pools; -1 = an empty row, which must read
    # zeros and write nothing. A row whose first token is at position 0 must start from zero state: a freed
    # slot is reused without clearing.
    state_slots: Any = None
    # A packed prefill (PACK_INDEX [B, T]): token_ids, positions, slot_mapping and window_slot_mapping are the rows'
    # tokens side by side, [1, N]; pack_index[b, t] is row b's token t's index in them (N: none); the other fields
    # are per row as usual. tlaloc_jax.serve.core.paging.pack_step_inputs builds it.
    pack_index: Any = None
    # LoRA (tlaloc_jax.lora): LORA_SLOTS [B], each row's adapter slot (0: none), and the adapter buffers
    # {"<target>.a": [L, S, I, R], "<target>.b": [L, S, R, O], "scale": [S]}; None without adapters.
    lora_slots: Any = None
    adapters: Any = None
