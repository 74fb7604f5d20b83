"""tlaloc_jax.serve: the JAX-free runtime (stdlib, numpy, ml_dtypes, pypjrt; never jax).

`Engine.load(artifact_dir)` validates an artifact, compiles its entries through a PJRT plugin,
uploads the weights once and keeps the KV pool on the device, donated to every execution.
"""

from .engine import Engine, RequestRefused, StepEvent
from .sampling import Sampling

__all__ = ["Engine", "RequestRefused", "StepEvent", "Sampling"]
