"""Builds the C kernels that CPU bodies may call as typed XLA FFI custom calls (`stablehlo.custom_call`,
api_version 4), and loads them.

Each kernel is one C file of the top-level `kernels/` folder (a wheel carries it as tlaloc_jax/csrc), its handler
named as its custom-call target (the target carries a version: a changed operand contract is a new name). It is
compiled on the machine that runs it, with the system C compiler (`$CC`, else `cc`), for that machine's instruction
set, and kept in a cache folder keyed by the source, the headers, the flags (DEFINES' limits among them) and the
compiler, as torch's inductor does for its CPU kernels. `xla_ffi_c_api.h` is XLA's FFI C API (jaxlib's
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
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

# The C sources and headers: kernels/ beside the package in a checkout (an editable install reads it there), which
# a wheel installs as tlaloc_jax/csrc (pyproject's package-dir).
_PACKAGE = Path(__file__).parent
SOURCES = _PACKAGE / "csrc" if (_PACKAGE / "csrc").is_dir() else _PACKAGE.parent / "kernels"
HEADER = SOURCES / "xla_ffi_c_api.h"          # jaxlib's include/xla/ffi/api/c_api.h
# custom-call target -> its C file; the handler is the C function of the target's name.
KERNELS = {"tlaloc_decode_attention_v1": "decode_attention.c", "tlaloc_projection_v1": "projection.c",
           "tlaloc_int4_projection_v1": "projection_int4.c"}
# Limits a kernel is compiled with (-DNAME=value) that its Python side also checks before a call: written here
# only, and part of the cache key with the other flags.
DEFINES = {"tlaloc_decode_attention_v1": {"MAX_GROUP": 16, "MAX_HEAD_DIM": 256}, "tlaloc_projection_v1": {},
           "tlaloc_int4_projection_v1": {}}
# The export option that stages a body without the kernel (the way out where it cannot be built).
WITHOUT = {"tlaloc_decode_attention_v1": "--decode-attention xla", "tlaloc_projection_v1": "--projections xla",
           "tlaloc_int4_projection_v1": "--projections xla"}
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


def _way_out(target: str) -> str:
    return f"install gcc or clang (or set $CC to one), or export the artifact with {WITHOUT[target]}"


def _short(path: Path) -> bool:
    """Whether `path` cannot be a whole shared library: shorter than an ELF header, or an ELF file that ends before
    its section headers or a segment (the loader maps those pages; reading past the end crashes it with SIGBUS)."""
    data = path.read_bytes()
    if len(data) < 64:
        return True
    if data[:4] != b"\x7fELF":
        return False                     # another format: the loader judges it
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"
    head = struct.unpack_from(order + ("16xHHIQQQIHHHHHH" if wide else "16xHHIIIIIHHHHHH"), data)
    phoff, shoff, phsize, phnum, shsize, shnum = head[4], head[5], head[8], head[9], head[10], head[11]
    if max(phoff + phsize * phnum, shoff + shsize * shnum) > len(data):
        return True
    try:
        segments = [struct.unpack_from(order + ("IIQQQQ" if wide else "IIIIII"), data, phoff + i * phsize)
                    for i in range(phnum)]
    except struct.error:                 # program headers that run past the end
        return True
    return any(s[2] + s[5] > len(data) if wide else s[1] + s[4] > len(data) for s in segments)


def library(target: str, rebuild: bool = False) -> Path:
    """The shared library holding `target`'s handler, built here unless the cache holds it whole (`rebuild`: built
    anew, replacing the cached copy)."""
    return _library(target, rebuild)[0]


def _library(target: str, rebuild: bool) -> tuple[Path, bool]:
    """library(), and whether this call built it."""
    if target not in KERNELS:
        raise NativeKernelError(f"native kernel {target!r} is not one this runtime has (it has "
                                f"{', '.join(sorted(KERNELS))}): serve the artifact with a tlaloc-jax that has it, "
                                "or export it without the kernels it lacks (--decode-attention xla, --projections xla)")
    source = SOURCES / KERNELS[target]
    cc = _compiler()
    flags = [*FLAGS, march(), *(f"-D{name}={value}" for name, value in DEFINES[target].items())]
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise NativeKernelError(f"native kernel {target!r} is built on the serving machine with a C compiler, and "
                                f"{shlex.join(cc)} does not run ({e}): {_way_out(target)}") from e
    headers = [h.read_bytes() for h in sorted(SOURCES.glob("*.h"))]
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, " ".join(flags).encode(),
                                     version.encode()])).hexdigest()[:24]
    out = cache_dir() / f"{target}-{key}.so"
    if out.is_file() and not rebuild and not _short(out):
        return out, False
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = tempfile.TemporaryDirectory(dir=out.parent)
    except OSError as e:
        raise NativeKernelError(f"native kernel {target!r}: cannot write its build to {out.parent} ({e}); set "
                                f"${ENV_CACHE} to a writable folder") from e
    with tmp_dir as tmp:
        built = Path(tmp) / out.name
        command = [*cc, *flags, f"-I{SOURCES}", str(source), "-o", str(built), "-lm"]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode:
            raise NativeKernelError(f"native kernel {target!r}: {shlex.join(cc)} failed on {source.name}:\n"
                                    f"{run.stderr.strip()}\n{_way_out(target)}")
        if not built.is_file() or _short(built):
            raise NativeKernelError(f"native kernel {target!r}: {shlex.join(cc)} exited 0 on {source.name} but wrote "
                                    f"no whole library ({shlex.join(command)}): {_way_out(target)}")
        os.replace(built, out)           # atomic: another process building the same key finds it whole
    return out, True


def _load(target: str) -> ctypes.CDLL:
    """`target`'s library loaded; a cached one that does not load is rebuilt once (replacing it atomically, as other
    processes may read it); one that still does not load is named with the command that clears it."""
    path, built = _library(target, False)
    while True:
        try:
            return ctypes.CDLL(str(path))
        except OSError as e:
            if built:
                raise NativeKernelError(
                    f"native kernel {target!r}: {path}, built just now, does not load ({e}); clear it with "
                    f"`rm {shlex.quote(str(path))}` (or the whole cache: `rm -r {shlex.quote(str(path.parent))}`), "
                    f"set ${ENV_CACHE} to another folder, or export the artifact with {WITHOUT[target]}") from e
        path, built = _library(target, True)


def handler(target: str) -> int:
    """The address of `target`'s FFI handler (XLA_FFI_Error *(*)(XLA_FFI_CallFrame *)), its library loaded and
    kept for the life of the process."""
    with _lock:
        if target not in _loaded:
            _loaded[target] = _load(target)
        return ctypes.cast(getattr(_loaded[target], target), ctypes.c_void_p).value
