"""tlaloc-jax: stage language models written in JAX for serving.

Importing this package is cheap and pulls in no JAX: `import tlaloc_jax.serve` must stay JAX-free.
The in-process API is loaded on first use.
"""

__all__ = ["load_hf", "Model", "DecoderConfig"]


def __getattr__(name):
    if name in ("load_hf", "Model"):
        from . import model
        return getattr(model, name)
    if name == "DecoderConfig":
        from .config import DecoderConfig
        return DecoderConfig
    raise AttributeError(f"module 'tlaloc_jax' has no attribute {name!r}")
