"""The C kernels, compiled at install for each instruction-set level of this machine (tlaloc_jax.native.VARIANTS)
into the package (tlaloc_jax/csrc, kernels/ in a checkout); the loader picks the best one the CPU has. pyproject.toml
holds everything else. A variant the compiler cannot build is skipped with a warning (optional): where no variant
fits, the loader builds the kernel on first use."""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup

_spec = importlib.util.spec_from_file_location("_tlaloc_native", Path(__file__).parent / "tlaloc_jax" / "native.py")
native = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)   # its dataclasses look it up
_spec.loader.exec_module(native)

setup(ext_modules=[
    Extension(f"tlaloc_jax.csrc.{module}", sources=[os.path.relpath(source, Path(__file__).parent)],
              extra_compile_args=flags, libraries=["m"], optional=True)
    for module, source, flags in native.prebuilt_builds()])
