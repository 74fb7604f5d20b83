"""Paged attention on CPU, 12 layers of the bench Llama's heads, compiled by the serving runtime's plugin, the forms
interleaved in one process. Decode (one token a row): the kernel's CPU form (32-key blocks scored as
multiply-reduces) against its dot form (128-key blocks, batched dots: what other platforms compile). --prefill T
(a chunk of T tokens a row after the keys already written): key blocks of CPU_KEY_BLOCK (tokens in tiles of
CPU_QUERY_BLOCK past that many) against one pass over the context bucket (the form of --attention-block 2048, other
platforms' default).

    python -m bench.decode_attention                      # 8 and 32 rows, 88 and 260 keys
    python -m bench.decode_attention --rows 32 --keys 200 --context 256
    python -m bench.decode_attention --prefill 32 --rows 8 --keys 224 --context 256
    python -m bench.decode_attention --shared 192          # the first 192 keys on pages every row shares

--shared N: the rows' first N keys sit on the same pages (a cached prefix), which the CPU form reads once for all
rows; the last column times it on tables where every row has its own pages.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--keys", default="88,260", help="keys each row has written")
    ap.add_argument("--context", type=int, default=512, help="the entry's context bucket")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--prefill", type=int, default=0, metavar="T", help="time a prompt chunk of T tokens a row")
    ap.add_argument("--shared", type=int, default=0, metavar="N", help="the first N keys on pages all rows share")
    a = ap.parse_args(argv)

    import jax.numpy as jnp

    from bench.common import on_runtime
    pa = importlib.import_module("tlaloc_jax.kernels.paged_attention")
    L, S, H, K, D = a.layers, 16, a.heads, a.kv_heads, a.head_dim
    M = a.context // S
    rng = np.random.default_rng(0)

    T = max(a.prefill, 1)

    def attend(form):
        def f(pool, q, tables, positions, seq_lens):
            out = 0.0
            for layer in range(L):
                args = (q + layer, pool, jnp.int32(layer), tables, positions, seq_lens, jnp.int32(0), None)
                if a.prefill:
                    block = pa.CPU_KEY_BLOCK if form == "cpu" else a.context
                    tiles = pa.CPU_QUERY_BLOCK if form == "cpu" and T > pa.CPU_QUERY_BLOCK else None
                    out = out + pa._paged_attention(0.125, None, block, False, tiles, *args)
                elif form == "cpu":
                    out = out + pa._decode_cpu(0.125, None, pa.CPU_DECODE_KEY_BLOCK, pa.CPU_SHARED_KEY_BLOCK, *args)
                else:
                    out = out + pa._paged_attention(0.125, None, 128, False, None, *args)
            return out
        return f

    print(f"{L} layers, {H} query / {K} KV heads of {D}, pages of {S}, context {a.context}, {T} tokens a row; "
          "the runtime plugin")
    forms = (("one pass", f"blocks of {pa.CPU_KEY_BLOCK}") if a.prefill else
             ("dot form, 128", f"CPU form, {pa.CPU_DECODE_KEY_BLOCK}"))
    shared = a.shared // S * S
    tail = f" | {'CPU, unshared':>14}" if shared else ""
    print(f"{'rows':>5} {'keys':>5} | {forms[0]:>14} | {forms[1]:>14} | ratio{tail}")
    for B in (int(x) for x in a.rows.split(",")):
        for n in (int(x) for x in a.keys.split(",")):
            P = B * M + 1
            pool = rng.standard_normal((L, 2, P, S, K, D), np.float32)
            q = rng.standard_normal((B, T, H, D), np.float32)
            tables = np.array([rng.permutation(P - 1)[:M] for _ in range(B)], np.int32)
            unshared = tables.copy()
            tables[:, :shared // S] = tables[0, :shared // S]
            positions = np.tile(np.arange(n - T, n, dtype=np.int32), (B, 1))      # the row's last T keys
            args = (pool, q, tables, positions, np.full((B,), n, np.int32))
            runs = {form: on_runtime(attend(form), *args) for form in ("dot", "cpu")}
            if shared:
                runs["unshared"] = on_runtime(attend("cpu"), pool, q, unshared, *args[3:])
            outs = {form: runs[form]()[0] for form in ("dot", "cpu")}   # the unshared tables hold other keys
            err = np.abs(outs["cpu"] - outs["dot"]).max() / np.abs(outs["dot"]).max()
            assert err < 1e-4, err
            times = {form: [] for form in runs}
            for i in range(a.steps + 2):
                for form, run in runs.items():
                    t0 = time.perf_counter()
                    run()
                    if i >= 2:
                        times[form].append(time.perf_counter() - t0)
            dot, cpu = (statistics.median(times[f]) for f in ("dot", "cpu"))
            tail = f" | {statistics.median(times['unshared']) * 1e3:11.2f} ms" if shared else ""
            print(f"{B:5d} {n:5d} | {dot * 1e3:11.2f} ms | {cpu * 1e3:11.2f} ms | {cpu / dot:.2f}x{tail}")


if __name__ == "__main__":
    main()
