"""tlaloc-jax: stage language models written in JAX for serving.

Importing this package is cheap and pulls in no JAX: `import tlaloc_jax.serve` must stay JAX-free.
The in-process API and the staging API are loaded on first use:

    tlaloc_jax.load_hf(path).generate(...)                   # a Hugging Face checkpoint, in process
    tlaloc_jax.stage(step, weights, {"kv": tlaloc_jax.PagedKV(...)}, "artifact/",   # an authored model
                     ladders=tlaloc_jax.Ladders(batch=(1, 4), context=(128, 512)))
    tlaloc_jax.stage_bounded(fn, params, {"ids": ids}, "artifact/", bounds={"tokens": tlaloc_jax.Bound(...)})
"""

_STAGING = ("stage", "Ladders", "Capacity", "Features", "ModelInfo", "Sampler", "SplitStep", "stage_bounded")
__all__ = ["load_hf", "Model", "DecoderConfig", *_STAGING, "PagedKV", "RingKV", "StateSlots", "StepInputs", "Bound",
           "Valid", "exact_valid", "EmbeddingTask"]


def __getattr__(name):
    if name in ("load_hf", "Model"):
        from . import model
        return getattr(model, name)
    if name == "DecoderConfig":
        from .config import DecoderConfig
        return DecoderConfig
    if name in _STAGING:
        from . import export
        return getattr(export, name)
    if name in ("PagedKV", "RingKV", "StateSlots"):
        from . import pools
        return getattr(pools, name)
    if name in ("Bound", "Valid", "exact_valid"):
        from . import bounds
        return getattr(bounds, name)
    if name == "EmbeddingTask":
        from .artifact.bounded_manifest import EmbeddingTask
        return EmbeddingTask
    if name == "StepInputs":
        from .inputs import StepInputs
        return StepInputs
    raise AttributeError(f"module 'tlaloc_jax' has no attribute {name!r}")
