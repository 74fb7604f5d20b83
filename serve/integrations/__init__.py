"""Serving a tlaloc artifact inside other serving systems: `vllm` (a vLLM platform plugin)."""
