"""`tlaloc_jax.serve.ray:app`, the import path Ray Serve is given (`serve run tlaloc_jax.serve.ray:app
artifact=DIR`): the application lives in serve/integrations/ray.py, whose public names this module re-exports."""

from .integrations.ray import *  # noqa: F401,F403
