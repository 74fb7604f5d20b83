"""Serving a tlaloc artifact inside other serving systems: `vllm` (a vLLM platform plugin), `ray` (a Ray Serve
application; tlaloc_jax.serve.ray re-exports it) and `triton` (a Triton model through PyTriton;
`python -m tlaloc_jax.serve.triton`)."""
