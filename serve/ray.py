"""`tlaloc_jax.serve.ray:app`, the import path Ray Serve is given (`serve run tlaloc_jax.serve.ray:app
artifact=DIR`): the application lives in serve/integrations/ray.py."""

from .integrations.ray import REPLICA_HEADER, OpenAIReplica, RayServeArgs, app

__all__ = ["REPLICA_HEADER", "OpenAIReplica", "RayServeArgs", "app"]
