"""tlaloc_jax.serve: the JAX-free runtime (stdlib, numpy, ml_dtypes, pypjrt; never jax).

`Engine.load(artifact_dir)` validates an artifact, compiles its entries through a PJRT plugin,
uploads the weights once and keeps the KV pool on the device, donated to every execution.
`BoundedProgram.load(artifact_dir)` serves a bounded program (an embedding model, a scorer: tlaloc_jax.stage_bounded).
"""

import importlib

# Imported when first named, so that the authoring side can use the JAX-free host paging (serve.core) without
# loading the PJRT client.
_EXPORTS = {"BoundedProgram": ".bounded_program", "CallRefused": ".bounded_program", "Engine": ".engine",
            "RequestRefused": ".engine", "StepEvent": ".engine", "Sampling": ".host_sampling"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
