"""Run a JAX function as the serving runtime would: exported (jax.export), compiled by the runtime's PJRT plugin
(whose XLA differs from in-process jaxlib's) and executed through serve.runtime.pjrt.Device.

    run = on_runtime(fn, *args, donate=(0,))    # args: numpy arrays (pytrees flattened)
    outputs = run()                               # host arrays of every output but the donated ones
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import export as jax_export  # noqa: E402

_DEVICE = None


def device():
    """One runtime Device for the process (no compile cache: a bench times fresh bodies)."""
    global _DEVICE
    if _DEVICE is None:
        from tlaloc_jax.serve.runtime.pjrt import Device
        _DEVICE = Device(None, cache_dir=None)
    return _DEVICE


def on_runtime(fn, *args, donate: tuple[int, ...] = (), custom_calls: tuple[str, ...] = ()):
    """fn(*args) compiled by the plugin; -> a callable running it on the uploaded args. Donated args (by position
    in `args`, each a pytree) are replaced by the outputs aliased to them after every run, as the runtime does.
    custom_calls: FFI targets fn may call (registered with the plugin by the caller)."""
    leaves, tree = jax.tree_util.tree_flatten(list(args))
    specs = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in leaves]
    donated_leaves = []
    for i in donate:
        start = len(jax.tree_util.tree_leaves(list(args[:i])))
        donated_leaves += list(range(start, start + len(jax.tree_util.tree_leaves(args[i]))))
    exp = jax_export.export(jax.jit(lambda *xs: fn(*jax.tree_util.tree_unflatten(tree, list(xs))),
                                    donate_argnums=tuple(donated_leaves)),
                            disabled_checks=[jax_export.DisabledSafetyCheck.custom_call(t) for t in custom_calls])(*specs)
    kept = sorted(exp.module_kept_var_idx)
    dev = device()
    exe = dev.compile(exp.mlir_module_serialized)
    bufs = [dev.upload(np.asarray(leaves[i])) for i in kept]
    # Donated inputs alias the leading outputs, in order (the donated leaves come back as the first outputs
    # only when fn returns them first: on_runtime's callers return their pools first).
    donated = [kept.index(i) for i in donated_leaves if i in kept]

    def run():
        outs = dev.execute(exe, bufs, donate=set(donated))
        for j, arg in enumerate(donated):
            bufs[arg] = outs[j]
        return [dev.to_host(o) for j, o in enumerate(outs) if j >= len(donated) and o is not None]
    return run
