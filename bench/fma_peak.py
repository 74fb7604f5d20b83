"""The f32 FMA rate this CPU reaches with every core: ten independent chains of vector fused multiply-adds per
thread (the widest vector the compiler targets here, as the native kernels are built: tlaloc_jax.native.march),
no memory traffic, one thread a core. It is the arithmetic ceiling of an f32 matmul, which a GEMM approaches and
never quite reaches (packing, loads and edges take the rest).

    python bench/fma_peak.py
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

_SOURCE = r"""
#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
#elif defined(__AVX__)
typedef float vec __attribute__((vector_size(32)));
#else
typedef float vec __attribute__((vector_size(16)));
#endif

int lanes(void) { return sizeof(vec) / sizeof(float); }

/* n rounds of ten independent a = a * m + c, each chain its own variable (kept in a register); -> a sum, so
   that nothing is dead. */
float fma_rounds(long n, float m0, float c0) {
    vec m, c, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9;
    for (int j = 0; j < lanes(); j++) {
        m[j] = m0; c[j] = c0;
        a0[j] = j; a1[j] = j + 1; a2[j] = j + 2; a3[j] = j + 3; a4[j] = j + 4;
        a5[j] = j + 5; a6[j] = j + 6; a7[j] = j + 7; a8[j] = j + 8; a9[j] = j + 9;
    }
    for (long r = 0; r < n; r++) {
        a0 = a0 * m + c; a1 = a1 * m + c; a2 = a2 * m + c; a3 = a3 * m + c; a4 = a4 * m + c;
        a5 = a5 * m + c; a6 = a6 * m + c; a7 = a7 * m + c; a8 = a8 * m + c; a9 = a9 * m + c;
    }
    vec t = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9;
    float s = 0;
    for (int j = 0; j < lanes(); j++) s += t[j];
    return s;
}
"""


@functools.cache
def _library() -> ctypes.CDLL:
    """The loop built once a process (the library stays loaded from its temporary folder, removed after)."""
    from tlaloc_jax.native import _compiler, march
    with tempfile.TemporaryDirectory(prefix="fma_peak") as tmp:
        tmp = Path(tmp)
        (tmp / "fma.c").write_text(_SOURCE)
        subprocess.run([*_compiler(), "-O2", "-ffp-contract=fast", "-shared", "-fPIC", march(), str(tmp / "fma.c"),
                        "-o", str(tmp / "fma.so")], check=True)
        lib = ctypes.CDLL(str(tmp / "fma.so"))
    lib.fma_rounds.argtypes = (ctypes.c_long, ctypes.c_float, ctypes.c_float)
    lib.fma_rounds.restype = ctypes.c_float
    return lib


def fma_peak(threads: int | None = None, seconds: float = 0.3, repeats: int = 5) -> float:
    """FLOP/s (2 a multiply-add) of `threads` threads (default: every core) running FMA chains at once; the best
    of `repeats` runs of about `seconds` each. ctypes releases the GIL, so the threads run in parallel."""
    lib = _library()
    threads = threads or os.cpu_count() or 1
    per_round = 2 * 10 * lib.lanes()   # ten chains
    n = 1 << 16
    while True:                                    # rounds for about `seconds` on one thread
        t0 = time.perf_counter()
        lib.fma_rounds(n, 0.999999, 1e-6)
        if time.perf_counter() - t0 > seconds / 4:
            break
        n *= 2
    n = int(n * seconds / max(time.perf_counter() - t0, 1e-6))
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=lib.fma_rounds, args=(n, 0.999999, 1e-6)) for _ in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, threads * n * per_round / (time.perf_counter() - t0))
    return best


if __name__ == "__main__":
    cores = os.cpu_count() or 1
    print(f"f32 FMA peak: {fma_peak(1) / 1e9:.1f} GFLOP/s on one thread, {fma_peak(cores) / 1e9:.1f} on {cores}")
