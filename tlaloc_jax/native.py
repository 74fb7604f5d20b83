"""Builds the C kernels that CPU bodies may call as typed XLA FFI custom calls (`stablehlo.custom_call`,
api_version 4), and loads them.

Each kernel is one C file of the top-level `kernels/` folder (a wheel carries it as tlaloc_jax/csrc), its handler
named as its custom-call target (the target carries a version: a changed operand contract is a new name). The
install (setup.py) compiles each for a few instruction-set levels (VARIANTS) into the package, and the loader takes
the best one this CPU has, as llama.cpp's CPU backend picks its variant by CPUID; a prebuilt library carries the
key of the sources it was built from, and a stale one (a checkout edited since its install) is passed over. Where
no variant fits, the kernel is compiled on the machine that runs it, with the system C compiler (`$CC`, else `cc`),
for that machine's instruction set, and kept in a cache folder keyed by the source, the headers, the flags
(DEFINES' limits among them), the CPU's features and the compiler, as torch's inductor does for its CPU kernels. `xla_ffi_c_api.h` is XLA's FFI C API (jaxlib's
include/xla/ffi/api/c_api.h, Apache-2.0), vendored so that a runtime without JAX can build the kernels; the tests
check it against jaxlib's copy.

Who registers a handler: the runtime with its plugin (tlaloc_jax.serve.runtime.Device.register_native), jax with
`tlaloc_jax.kernels.paged_attention_native.register_in_process` for in-process calls (the decode attention and
projection wrappers call it when traced). Standard library only.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.machinery
import logging
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
COMPILE_FLAGS = ("-O3", "-fopenmp-simd", "-ffp-contract=fast", "-std=c11")
FLAGS = (*COMPILE_FLAGS, "-shared", "-fPIC")          # a build here compiles and links in one command
ENV_CACHE = "TLALOC_NATIVE_CACHE"
# The loader's override: a variant's name (one this CPU has), or "build" (compile here, as where none fits).
ENV_VARIANT = "TLALOC_NATIVE_VARIANT"
# XLA's --xla_cpu_max_isa (which `make test-isa` sets) -> the same limit for the C kernels on x86-64.
_X86_ISA = {"SSE4_2": "x86-64-v2", "AVX": "sandybridge", "AVX2": "haswell", "AVX512": "skylake-avx512"}
_ISA_RANK = {"SSE4_2": 0, "AVX": 1, "AVX2": 2, "AVX512": 3}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One instruction-set level a kernel is prebuilt for: its compiler flags, the CPU features (/proc/cpuinfo's
    names) it needs, and the XLA ISA limit (_ISA_RANK) it stays within."""

    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]
    isa: str | None = None


_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# Best first, per machine (platform.machine()); the x86-64 levels are the psABI's microarchitecture levels.
VARIANTS = {
    "x86_64": (Variant("x86-64-v4-vnni", ("-march=x86-64-v4", "-mavx512vnni"), _V4 | {"avx512_vnni"}, "AVX512"),
               Variant("x86-64-v4", ("-march=x86-64-v4",), _V4, "AVX512"),
               Variant("x86-64-v3", ("-march=x86-64-v3",), _V3, "AVX2"),
               Variant("x86-64-v2", ("-march=x86-64-v2",), _V2, "SSE4_2")),
    "aarch64": (Variant("armv8.2-a-sve", ("-march=armv8.2-a+sve",), frozenset({"asimdrdm", "atomics", "sve"})),
                Variant("armv8.2-a", ("-march=armv8.2-a",), frozenset({"asimdrdm", "atomics"}))),
}
log = logging.getLogger(__name__)

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}
_variant: dict[str, str] = {}           # target -> the variant loaded, or how it was built


def loaded_variant(target: str) -> str | None:
    """Which variant of `target` this process loaded (None before its first load)."""
    return _variant.get(target)


def loaded_variant_env() -> dict[str, str]:
    """The environment under which a new process loads the variants this one loaded (compile workers, whose facts
    must be their server's): TLALOC_NATIVE_VARIANT, one name for every kernel or target=name pairs where they differ,
    "build" for kernels built here; nothing where none was loaded."""
    loaded = {t: "build" if v.startswith("built here") else v for t, v in sorted(_variant.items())}
    if len(set(loaded.values())) > 1:
        return {ENV_VARIANT: ",".join(f"{t}={v}" for t, v in loaded.items())}
    return {ENV_VARIANT: v for v in set(loaded.values())}


def _wanted_variant(target: str) -> str | None:
    """TLALOC_NATIVE_VARIANT for `target`: its one name, or the name its target=name pair gives (None: the best)."""
    wanted = os.environ.get(ENV_VARIANT)
    if wanted and "=" in wanted:
        return dict(pair.split("=", 1) for pair in wanted.split(",") if "=" in pair).get(target)
    return wanted


class NativeKernelError(RuntimeError):
    """A native kernel is unknown or could not be built here; the message names it and says why."""


def march() -> str:
    """The instruction set the kernels are built for: this machine's, limited as XLA_FLAGS' --xla_cpu_max_isa
    limits XLA's own code."""
    isa = _xla_max_isa()
    if isa in _X86_ISA and platform.machine() in ("x86_64", "AMD64"):
        return f"-march={_X86_ISA[isa]}"
    return "-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native"


def machine() -> str:
    """VARIANTS' key for this machine."""
    return {"AMD64": "x86_64", "arm64": "aarch64"}.get(platform.machine(), platform.machine())


def cpu_features() -> frozenset[str]:
    """This CPU's features as Linux names them (/proc/cpuinfo's `flags` on x86, `Features` on Arm); empty where
    that file is not there, so that no prebuilt variant is taken on trust."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.MULTILINE)
    return frozenset(line.group(1).split()) if line else frozenset()


def _xla_max_isa() -> str | None:
    """XLA_FLAGS' --xla_cpu_max_isa, upper-cased (None where unset)."""
    isa = re.search(r"--xla_cpu_max_isa=(\w+)", os.environ.get("XLA_FLAGS", ""))
    return isa.group(1).upper() if isa else None


def _isa_limit() -> int:
    return _ISA_RANK.get(_xla_max_isa(), len(_ISA_RANK))


def usable_variants() -> list[Variant]:
    """The prebuilt variants this CPU runs, best first, within XLA_FLAGS' --xla_cpu_max_isa (as XLA's own code)."""
    have, limit = cpu_features(), _isa_limit()
    return [v for v in VARIANTS.get(machine(), ()) if v.needs <= have and (v.isa is None or _ISA_RANK[v.isa] <= limit)]


def source_key(target: str) -> str:
    """What a kernel's library is built from: its source, the headers and its limits (not the compiler or the
    instruction set, which a variant's name or the cache key carries)."""
    headers = [h.read_bytes() for h in sorted(SOURCES.glob("*.h"))]
    return hashlib.sha256(b"\0".join([(SOURCES / KERNELS[target]).read_bytes(), *headers,
                                      " ".join(_defines(target)).encode()])).hexdigest()[:24]


def _defines(target: str) -> list[str]:
    """DEFINES' limits of `target` as compiler flags."""
    return [f"-D{name}={value}" for name, value in DEFINES[target].items()]


def prebuilt_module(target: str, variant: Variant) -> str:
    """The module name (inside the csrc package) a prebuilt variant is installed as."""
    return f"_{target}_{re.sub(r'[^0-9A-Za-z]', '_', variant.name)}"


def prebuilt_builds() -> list[tuple[str, Path, list[str]]]:
    """(module, source, compiler flags) of every prebuilt variant for this machine: what setup.py compiles."""
    return [(prebuilt_module(t, v), SOURCES / source,
             [*COMPILE_FLAGS, *v.flags, *_defines(t), f'-DTLALOC_KERNEL_KEY="{source_key(t)}"'])
            for t, source in KERNELS.items() for v in VARIANTS.get(machine(), ())]


def _prebuilt(target: str) -> tuple[ctypes.CDLL, str] | None:
    """The best installed variant of `target` this CPU runs and that was built from today's sources, loaded, with
    its name; None where there is none (or ENV_VARIANT says "build")."""
    wanted = _wanted_variant(target)
    if wanted == "build":
        return None
    usable = usable_variants()
    if wanted:
        known = [v.name for v in VARIANTS.get(machine(), ())]
        if wanted not in known:
            raise NativeKernelError(f"${ENV_VARIANT}={wanted!r} is not a variant of this machine (known: "
                                    f"{', '.join(known) or 'none'}; or \"build\")")
        if wanted not in [v.name for v in usable]:
            raise NativeKernelError(f"${ENV_VARIANT}={wanted!r}: this CPU (or XLA_FLAGS' ISA limit) lacks what "
                                    "it needs; choose one of " + (", ".join(v.name for v in usable) or '"build"'))
        usable = [v for v in usable if v.name == wanted]
    key = source_key(target).encode()
    for variant in usable:
        for path in sorted(SOURCES.glob(prebuilt_module(target, variant) + ".*")):
            if not any(path.name.endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES):
                continue
            try:
                lib = ctypes.CDLL(str(path))
                built_from = (ctypes.c_char * (len(key) + 1)).in_dll(lib, "tlaloc_kernel_key").value
            except (OSError, ValueError) as e:
                log.warning("native kernel %s: prebuilt %s does not load (%s); passed over", target, path.name, e)
                continue
            if built_from != key:
                log.warning("native kernel %s: prebuilt %s is from other sources (reinstall: make setup); passed "
                            "over", target, path.name)
                continue
            return lib, variant.name
    return None


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


def unavailable(targets, missing: dict[str, Exception]) -> NativeKernelError:
    """The error for an artifact calling `targets` of which `missing` ({target: why}) cannot be had: its first line
    names every kernel the artifact needs, the export flags that stage its bodies without them, and why."""
    flags = " ".join(WITHOUT[t] for t in targets if t in WITHOUT) or "a tlaloc-jax that has them"
    why = "; ".join(f"{t}: {str(e).splitlines()[0]}" for t, e in missing.items())
    return NativeKernelError(f"this artifact calls the native kernels {', '.join(targets)}, and {', '.join(missing)} "
                             f"cannot be had here; re-export it with {flags} (bodies without native kernels), or "
                             f"install gcc or clang (or set $CC) so they build on first load. Why: {why}")


def _known(target: str) -> None:
    if target not in KERNELS:
        raise NativeKernelError(f"native kernel {target!r} is not one this runtime has (it has "
                                f"{', '.join(sorted(KERNELS))}): serve the artifact with a tlaloc-jax that has it, "
                                "or export it without the kernels it lacks (--decode-attention xla, --projections xla)")


def _library(target: str, rebuild: bool) -> tuple[Path, bool]:
    """library(), and whether this call built it."""
    _known(target)
    source = SOURCES / KERNELS[target]
    cc = _compiler()
    flags = [*FLAGS, march(), *_defines(target)]
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise NativeKernelError(f"native kernel {target!r} is built on the serving machine with a C compiler, and "
                                f"{shlex.join(cc)} does not run ({e}): {_way_out(target)}") from e
    # -march=native means this CPU: its features enter the key, so a cache shared with another CPU is not taken.
    features = " ".join(sorted(cpu_features())) if any(f.endswith("=native") for f in flags) else ""
    key = hashlib.sha256("\0".join([source_key(target), " ".join(flags), version, features]).encode()
                         ).hexdigest()[:24]
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
    """`target`'s library loaded: the best prebuilt variant, else one built here (a cached one that does not load is
    rebuilt once, replacing it atomically, as other processes may read it; one that still does not load is named
    with the command that clears it)."""
    _known(target)
    prebuilt = _prebuilt(target)
    if prebuilt is not None:
        log.info("native kernel %s: prebuilt variant %s", target, prebuilt[1])
        _variant[target] = prebuilt[1]
        return prebuilt[0]
    path, built = _library(target, False)
    _variant[target] = f"built here ({march()})"
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
