"""tlaloc-jax: stage language models written in JAX for serving.

Importing this package is cheap and pulls in no JAX: `import tlaloc_jax.serve` must stay JAX-free.
The in-process API and the staging API are loaded on first use:

    tlaloc_jax.load_hf(path).generate(...)                   # a Hugging Face checkpoint, in process
    tlaloc_jax.stage(step, weights, {"kv": tlaloc_jax.PagedKV(...)}, "artifact/")   # an authored model
"""

__all__ = ["load_hf", "Model", "DecoderConfig", "stage", "PagedKV", "RingKV", "StateSlots", "StepInputs"]


def __getattr__(name):
    if name in ("load_hf", "Model"):
        from . import model
        return getattr(model, name)
    if name == "DecoderConfig":
        from .config import DecoderConfig
        return DecoderConfig
    if name in ("stage", "PagedKV", "RingKV", "StateSlots"):
        from . import export
        return getattr(export, name)
    if name == "StepInputs":
        from .inputs import StepInputs
        return StepInputs
    raise AttributeError(f"module 'tlaloc_jax' has no attribute {name!r}")
