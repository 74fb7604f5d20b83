"""tlaloc_jax.serve: the JAX-free runtime (stdlib, numpy, ml_dtypes, pypjrt; never jax).

`Engine.load(artifact_dir)` validates an artifact, compiles its entries through a PJRT plugin,
uploads the weights once and keeps the KV pool on the device, donated to every execution.
`BoundedProgram.load(artifact_dir)` serves a bounded program (an embedding model, a scorer: tlaloc_jax.stage_bounded).
"""

from .bounded import BoundedProgram, CallRefused
from .engine import Engine, RequestRefused, StepEvent
from .sampling import Sampling

__all__ = ["BoundedProgram", "CallRefused", "Engine", "RequestRefused", "StepEvent", "Sampling"]
