"""tlaloc_jax.export: a checkpoint -> a serving artifact (`python -m tlaloc_jax.export --help`)."""

from ._artifact import export_checkpoint
from ._entries import ExportError, check_custom_calls, custom_call_targets, plan_entries

__all__ = ["export_checkpoint", "ExportError", "check_custom_calls", "custom_call_targets", "plan_entries"]
