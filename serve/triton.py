"""`python -m tlaloc_jax.serve.triton ARTIFACT_DIR ...`: the Triton server of serve/integrations/triton.py."""

import sys

from .integrations.triton import TritonModel, main

__all__ = ["TritonModel", "main"]

if __name__ == "__main__":
    sys.exit(main())
