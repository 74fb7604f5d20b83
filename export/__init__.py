"""tlaloc_jax.export: stage a step function (`stage`) or a Hugging Face checkpoint (`export_checkpoint`,
`python -m tlaloc_jax.export --help`) as a serving artifact, or a function that is not a decoder as a
bounded-program artifact (`stage_bounded`)."""

from tlaloc_jax.decoder import decoder_pools
from tlaloc_jax.pools import PagedKV, RingKV, StateSlots

from ._artifact import export_checkpoint
from ._entries import ExportError, check_custom_calls, custom_call_targets, plan_entries
from ._options import Capacity, Features, Ladders, ModelInfo, Sampler, SplitStep
from ._stage import stage
from ._stage_bounded import stage_bounded
from ._weights import flatten_weights

__all__ = ["stage", "Ladders", "Capacity", "Features", "ModelInfo", "Sampler", "SplitStep",
           "stage_bounded", "PagedKV", "RingKV", "StateSlots", "export_checkpoint", "decoder_pools",
           "flatten_weights", "ExportError", "check_custom_calls", "custom_call_targets", "plan_entries"]
