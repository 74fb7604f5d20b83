"""The import guard the serving-path tests run their subprocesses under: jax, jaxlib, flax, torch and
transformers raise ImportError, so a serving process that reaches for them fails."""

GUARD = '''
import importlib.abc, sys
BANNED = {"jax", "jaxlib", "flax", "torch", "transformers"}
class Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BANNED:
            raise ImportError(f"the serving path imported {name}")
sys.meta_path.insert(0, Guard())
'''


def guarded(script: str) -> str:
    """`script` run after the guard is installed (BANNED is defined for it)."""
    return GUARD + script
