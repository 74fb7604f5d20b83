"""C kernels that CPU bodies may call as typed XLA FFI custom calls (`stablehlo.custom_call`, api_version 4).

Each kernel is one C file here, its handler named as its custom-call target (the target carries a version: a
changed operand contract is a new name). It is compiled on the machine that runs it, with the system C compiler
(`$CC`, else `cc`), for that machine's instruction set, and kept in a cache folder keyed by the source, the flags and
the compiler, as torch's inductor does for its CPU kernels. `xla_ffi_c_api.h` is XLA's FFI C API (jaxlib's
include/xla/ffi/api/c_api.h, Apache-2.0), vendored so that a runtime without JAX can build the kernels; the tests
check it against jaxlib's copy.

Who registers a handler: the runtime with its plugin (tlaloc_jax.serve.runtime.Device.register_native), jax with
`tlaloc_jax.kernels.paged_attention_native.register_in_process` for in-process calls (the decode attention and
projection wrappers call it when traced). Standard library only.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).parent
HEADER = HERE / "xla_ffi_c_api.h"          # jaxlib's include/xla/ffi/api/c_api.h
# custom-call target -> its C file; the handler is the C function of the target's name.
KERNELS = {"tlaloc_decode_attention_v1": "decode_attention.c", "tlaloc_projection_v1": "projection.c"}
# The export option that stages a body without the kernel (the way out where it cannot be built).
WITHOUT = {"tlaloc_decode_attention_v1": "--decode-attention xla", "tlaloc_projection_v1": "--projections xla"}
# OpenMP's simd pragmas only (no runtime); a * b + c contracted into an FMA (one rounding, as a dot's).
FLAGS = ("-O3", "-fopenmp-simd", "-ffp-contract=fast", "-shared", "-fPIC", "-std=c11")
ENV_CACHE = "TLALOC_NATIVE_CACHE"
# XLA's --xla_cpu_max_isa (which `make test-isa` sets) -> the same limit for the C kernels on x86-64.
_X86_ISA = {"SSE4_2": "x86-64-v2", "AVX": "sandybridge", "AVX2": "haswell", "AVX512": "skylake-avx512"}

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}


class NativeKernelError(RuntimeError):
    """A native kernel is unknown or could not be built here; the message names it and says why."""


def march() -> str:
    """The instruction set the kernels are built for: this machine's, limited as XLA_FLAGS' --xla_cpu_max_isa
    limits XLA's own code."""
    isa = re.search(r"--xla_cpu_max_isa=(\w+)", os.environ.get("XLA_FLAGS", ""))
    if isa and platform.machine() in ("x86_64", "AMD64") and isa.group(1).upper() in _X86_ISA:
        return f"-march={_X86_ISA[isa.group(1).upper()]}"
    return "-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native"


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tlaloc-jax" / "native"
    return Path(os.environ.get(ENV_CACHE) or default)


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def library(target: str) -> Path:
    """The shared library holding `target`'s handler, built here unless the cache holds it."""
    if target not in KERNELS:
        raise NativeKernelError(f"native kernel {target!r} is not one this runtime has (it has "
                                f"{', '.join(sorted(KERNELS))}): serve the artifact with a tlaloc-jax that has it, "
                                "or export it without the kernels it lacks (--decode-attention xla, --projections xla)")
    source = HERE / KERNELS[target]
    cc = _compiler()
    flags = [*FLAGS, march()]
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise NativeKernelError(f"native kernel {target!r} is built on the serving machine with a C compiler, and "
                                f"{shlex.join(cc)} does not run ({e}): install gcc or clang (or set $CC), or export "
                                f"the artifact with {WITHOUT[target]}") from e
    headers = [h.read_bytes() for h in sorted(HERE.glob("*.h"))]
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, " ".join(flags).encode(),
                                     version.encode()])).hexdigest()[:24]
    out = cache_dir() / f"{target}-{key}.so"
    if out.is_file():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = tempfile.TemporaryDirectory(dir=out.parent)
    except OSError as e:
        raise NativeKernelError(f"native kernel {target!r}: cannot write its build to {out.parent} ({e}); set "
                                f"${ENV_CACHE} to a writable folder") from e
    with tmp_dir as tmp:
        built = Path(tmp) / out.name
        run = subprocess.run([*cc, *flags, f"-I{HERE}", str(source), "-o", str(built), "-lm"],
                             capture_output=True, text=True)
        if run.returncode:
            raise NativeKernelError(f"native kernel {target!r}: {shlex.join(cc)} failed on {source.name}:\n"
                                    f"{run.stderr.strip()}")
        os.replace(built, out)           # atomic: another process building the same key finds it whole
    return out


def handler(target: str) -> int:
    """The address of `target`'s FFI handler (XLA_FFI_Error *(*)(XLA_FFI_CallFrame *)), its library loaded and
    kept for the life of the process."""
    with _lock:
        if target not in _loaded:
            _loaded[target] = ctypes.CDLL(str(library(target)))
        return ctypes.cast(getattr(_loaded[target], target), ctypes.c_void_p).value
