"""The tolerance model's path length of an arbitrary JAX function: for each output, the roundings on the longest
path from the inputs to one of its values, counted over the function's jaxpr (tlaloc_jax/kernels/tolerances.py explains the
model and how each op counts).

`stage_bounded` compares a program's padded result with its exact-size result; the two are the same math rounded
in another order (longer sums over zeros, other blockings), so they differ by at most what the tolerance model
allows for the longer of the two paths, the padded one, which is what is counted here.

Counting, per op, in roundings of the op's output dtype: an n-term sum (reduce_sum over n values, a dot_general
or convolution contracting n, a cumulative sum along n) is n; an arithmetic op is one (integer_pow y is y - 1
products); a transcendental function (exp, log, tanh, logistic, rsqrt, erf, pow ...) is TRANSCENDENTAL_ULPS;
rounding to a narrower float dtype is one; moving, selecting and comparing values (reshape, gather, select, max,
sort ...) and integer ops round nothing. An op this table does not know counts as a transcendental function, the
larger of the two. A path is a {dtype: count} map; of two paths the longer is the one of larger variance
(sum of u(dtype)^2 count). Loops: a scan's body counts once per iteration; a while_loop's trip count is unknown,
so a function with one is refused (write it as a fori_loop with static bounds, which is a scan).
"""

from __future__ import annotations

import math
from typing import Mapping

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from tlaloc_jax.kernels.tolerances import TRANSCENDENTAL_ULPS, unit_roundoff

from ._entries import ExportError

Path = Mapping[str, int]

_FREE = frozenset({
    "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice", "dynamic_slice",
    "dynamic_update_slice", "gather", "scatter", "concatenate", "pad", "select_n", "neg", "abs", "sign", "max", "min",
    "reduce_max", "reduce_min", "argmax", "argmin", "eq", "ne", "lt", "gt", "le", "ge", "and", "or", "not", "xor",
    "iota", "copy", "copy_p", "stop_gradient", "sort", "rev", "clamp", "floor", "ceil", "round", "is_finite",
    "bitcast_convert_type", "reduce_precision", "optimization_barrier", "real", "imag", "top_k", "cummax", "cummin",
    "sharding_constraint", "device_put", "split", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "population_count", "clz", "nextafter", "reduce_and", "reduce_or", "reduce_xor", "conj",
})
_ONE = frozenset({"add", "sub", "mul", "div", "rem", "sqrt", "square", "add_any"})
_SUMS = frozenset({"reduce_sum", "reduce_prod"})
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cumlogsumexp"})
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr", "custom_lin": "jaxpr"}


def variance(path: Path) -> float:
    return sum(unit_roundoff(d) ** 2 * n for d, n in path.items())


def _longest(paths) -> dict[str, int]:
    return dict(max(paths, key=variance, default={}))


def _plus(path: Path, dtype: str, n: int) -> dict[str, int]:
    out = dict(path)
    if n:
        out[dtype] = out.get(dtype, 0) + n
    return out


def _floating(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)      # numpy's issubdtype does not know bfloat16 is a float


def _is_float(aval) -> bool:
    return _floating(aval.dtype)


def _cost(eqn) -> int:
    """The roundings one equation adds to its (float) outputs."""
    name = eqn.primitive.name
    if name in _FREE:
        return 0
    if name in _ONE:
        return 1
    if name == "integer_pow":
        return max(abs(int(eqn.params["y"])) - 1, 1)
    if name == "convert_element_type":
        src, dst = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.outvars[0].aval.dtype)
        narrower = _floating(src) and unit_roundoff(dst) > unit_roundoff(src)
        return 1 if narrower or not _floating(src) else 0
    if name in _SUMS:
        shape = eqn.invars[0].aval.shape
        return math.prod(shape[a] for a in eqn.params["axes"])
    if name in _CUMULATIVE:
        return eqn.invars[0].aval.shape[eqn.params["axis"]]
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        shape = eqn.invars[0].aval.shape
        return math.prod(shape[a] for a in lhs_contract)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        spec = eqn.params["dimension_numbers"].rhs_spec      # (out features, in features, spatial...)
        return math.prod(rhs[a] for a in spec[1:])
    return TRANSCENDENTAL_ULPS


def _jaxpr_paths(jaxpr, in_paths: list[dict[str, int]]) -> list[dict[str, int]]:
    """The longest path to each output of `jaxpr` (a core.Jaxpr), given the paths of its inputs."""
    env: dict = {}

    def read(v):
        return {} if isinstance(v, jex_core.Literal) else env.get(v, {})

    for v in jaxpr.constvars:
        env[v] = {}
    for v, p in zip(jaxpr.invars, in_paths):
        env[v] = p
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        for v, p in zip(eqn.outvars, _eqn_paths(eqn, ins)):
            env[v] = p if _is_float(v.aval) else {}
    return [read(v) for v in jaxpr.outvars]


def _inner(j):
    """A ClosedJaxpr's or a Jaxpr's core.Jaxpr."""
    return getattr(j, "jaxpr", j)


def _eqn_paths(eqn, ins: list[dict[str, int]]) -> list[dict[str, int]]:
    name = eqn.primitive.name
    if name in _CALLS and _CALLS[name] in eqn.params:
        return _jaxpr_paths(_inner(eqn.params[_CALLS[name]]), ins)
    if name == "cond":
        branches = [_jaxpr_paths(_inner(b), ins[1:]) for b in eqn.params["branches"]]
        return [_longest(outs) for outs in zip(*branches)]
    if name == "scan":
        # One iteration from zero, then that many times over: what each iteration adds to the carry.
        body = _inner(eqn.params["jaxpr"])
        per_step = _jaxpr_paths(body, [{} for _ in body.invars])
        base = _longest(ins)
        length = int(eqn.params["length"])
        return [{d: base.get(d, 0) + length * per_step[i].get(d, 0) for d in {*base, *per_step[i]}}
                for i in range(len(eqn.outvars))]
    if name == "while":
        raise ExportError("the function holds a lax.while_loop, whose trip count is known only at run time, so the "
                          "tolerance model cannot count its roundings; write it as lax.fori_loop with static bounds "
                          "or lax.scan")
    base = _longest(ins)
    cost = _cost(eqn)
    return [_plus(base, np.dtype(v.aval.dtype).name, cost) if _is_float(v.aval) else {} for v in eqn.outvars]


def output_roundings(closed_jaxpr) -> list[dict[str, int]]:
    """For each output of a ClosedJaxpr (jax.make_jaxpr's result), the roundings on the longest path to one of its
    values, as {dtype name: count}; {} for integer and boolean outputs."""
    jaxpr = _inner(closed_jaxpr)
    return _jaxpr_paths(jaxpr, [{} for _ in jaxpr.invars])
