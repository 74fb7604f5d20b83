"""Bounded programs (issue 16): tlaloc_jax.stage_bounded and the JAX-free BoundedProgram.

Two programs (tests/support/bounded_models.py): an embedder with a batch bound and a length bound, and a scorer with two
length bounds. Served at 1, one below, at and one above each bucket edge, and the maximum, each result equals the
in-process one (the same function at the exact size) within the tolerance model's bound for the output's longest
path, which the exporter counts on the largest body and records in the manifest (export/_roundings.py, checked
here on hand-worked cases). Controls: programs that read padding are refused at export, naming the output and the
bucket; a runtime that filled every mask as valid is caught by the same comparison that passes."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import bounded_models as bmod
import tlaloc_jax
from margins import assert_within
from tlaloc_jax import artifact as af
from tlaloc_jax import exact_valid
from tlaloc_jax.artifact import bounded_manifest as bm
from tlaloc_jax.export import ExportError
from tlaloc_jax.export._roundings import output_roundings
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.serve import BoundedProgram, CallRefused, Engine
from tlaloc_jax.serve import bounded_program as serve_bounded

V, MAX_TOKENS, MAX_ROWS = 40, 16, 4


@pytest.fixture(scope="module")
def embed_setup(tmp_path_factory):
    params = bmod.embed_params(V, MAX_TOKENS)
    ids = np.random.default_rng(3).integers(0, V, (MAX_ROWS, MAX_TOKENS)).astype(np.int32)
    out = tmp_path_factory.mktemp("bounded") / "embed"
    m = tlaloc_jax.stage_bounded(bmod.embed, params, {"ids": ids}, out, bounds=bmod.embed_bounds(), name="embedder",
                                 embedding=tlaloc_jax.EmbeddingTask("ids", "embedding", V), progress=False)
    return m, out, params, ids


@pytest.fixture(scope="module")
def cross_setup(tmp_path_factory):
    params = bmod.cross_params()
    out = tmp_path_factory.mktemp("bounded") / "cross"
    m = tlaloc_jax.stage_bounded(bmod.cross, params, bmod.cross_examples(), out, bounds=bmod.cross_bounds(),
                                 name="scorer", progress=False)
    return m, out, params


def _in_process(fn, params, bounds):
    """fn at the call's exact sizes, every position valid: what the author runs in process."""
    params = jax.tree.map(jnp.asarray, params)
    return jax.jit(lambda inputs: fn(params, inputs, exact_valid(bounds, inputs)))


def _ran(program: BoundedProgram, call) -> tuple[dict, list[str]]:
    """(the program's answer to `call`, the programs it executed)."""
    before = dict(program.executions)
    out = program.run(call)
    return out, [n for n, k in program.executions.items() if k != before.get(n, 0)]


def _bound(m: bm.BoundedManifest, output: str) -> float:
    return tol.bound(dict(m.output(output).roundings))


def test_the_manifest_records_bounds_axes_and_one_program_per_bucket_pair(embed_setup, cross_setup):
    m, out, _, _ = embed_setup
    assert m.schema == bm.SCHEMA_V2 and (out / bm.BOUNDED_NAME).is_file()
    # The runtime's files alone: each program's bytecode, no textual body, jax serialization or programs/ folder.
    assert {f"bodies/{p.name}" for p in (out / "bodies").iterdir()} == {p.serialized for p in m.programs}
    assert not (out / "programs").exists() and not any(p.body or p.exported or p.program for p in m.programs)
    assert [(b.name, b.kind, b.max, b.buckets) for b in m.bounds] == [
        ("rows", af.BoundKind.BATCH, 4, (1, 2, 4)), ("tokens", af.BoundKind.LENGTH, 16, (4, 8, 16))]
    assert [(s.name, s.axes) for s in m.outputs] == [("embedding", ("rows", "")), ("hidden", ("rows", "tokens", ""))]
    assert len(m.programs) == 9 and {p.name for p in m.programs} >= {"rows1_tokens4", "rows4_tokens16"}
    p = next(p for p in m.programs if p.name == "rows2_tokens8")
    assert [(s.role, s.slot, s.shape) for s in p.inputs[:5]] == [
        (af.Role.INPUT, "ids", (2, 8)), (af.Role.VALID_LENGTH, "rows", ()), (af.Role.VALID_MASK, "rows", (2,)),
        (af.Role.VALID_LENGTH, "tokens", (2,)), (af.Role.VALID_MASK, "tokens", (2, 8))]
    assert all(s.role == af.Role.WEIGHT for s in p.inputs[5:]) and len(p.inputs) == 5 + len(m.weights)
    cm = cross_setup[0]
    assert [(s.name, s.axes) for s in cm.outputs] == [("attended", ("query", "")), ("doc_weight", ("doc",)),
                                                      ("score", ())]
    q4 = next(p for p in cm.programs if p.name == "query4_doc16")
    assert [(s.slot, s.shape) for s in q4.inputs if s.role != af.Role.WEIGHT] == [
        ("query", (4, bmod.F)), ("doc", (16, bmod.F)), ("query", ()), ("query", (4,)), ("doc", ()), ("doc", (16,))]


def test_roundings_are_counted_on_hand_worked_cases():
    """export/_roundings.py against counts done by hand: a K-term dot is K, tanh TRANSCENDENTAL_ULPS, an n-term
    sum n, a divide 1, a 5-step scan whose step multiplies and adds is 10, moving values nothing, bf16 its own."""
    t = tol.TRANSCENDENTAL_ULPS

    def f(x, w):
        y = jnp.tanh(x @ w)                                        # 7 + 4
        pooled = jnp.sum(y, axis=0) / 3.0                          # + 5 + 1
        carry, _ = lax.scan(lambda c, r: (c * 0.5 + r, None), jnp.zeros(3), y)      # 5 steps of 2
        return pooled, carry, jnp.argmax(y), y.T[::-1].reshape(-1), y.astype(jnp.bfloat16) * 2

    got = output_roundings(jax.make_jaxpr(f)(jnp.ones((5, 7)), jnp.ones((7, 3))))
    path = 7 + t
    assert got == [{"float32": path + 5 + 1}, {"float32": path + 10}, {}, {"float32": path},
                   {"float32": path, "bfloat16": 2}]


@pytest.mark.numeric
def test_the_embedder_serves_its_in_process_results_at_every_bucket_edge(embed_setup, serve_cache_dir):
    m, out, params, ids = embed_setup
    ref = _in_process(bmod.embed, params, bmod.embed_bounds())
    tokens = bmod.edge_sizes((4, 8, 16), MAX_TOKENS)
    with BoundedProgram.load(out, cache_dir=serve_cache_dir) as program:
        for rows, n in bmod.sweep([1, 2, 3, 4], tokens):
            call = {"ids": ids[:rows, :n]}
            got, ran = _ran(program, call)
            assert ran == [f"rows{next(b for b in (1, 2, 4) if b >= rows)}_tokens{next(b for b in (4, 8, 16) if b >= n)}"]
            want = ref(call)
            for name in ("embedding", "hidden"):
                assert got[name].shape == want[name].shape
                assert_within(tol.relative_error(got[name], want[name]), _bound(m, name),
                              f"bounded embedder {name} rows={rows} tokens={n}")


@pytest.mark.numeric
def test_calls_of_several_sizes_share_bodies_and_each_gets_its_own_result(embed_setup, serve_cache_dir):
    """Seven calls of one and two rows, 1 to 16 tokens: packed into bodies of four rows by length, each row with its
    own length; every call's result is its in-process one."""
    m, out, params, ids = embed_setup
    ref = _in_process(bmod.embed, params, bmod.embed_bounds())
    calls = [{"ids": ids[r % 4:r % 4 + k, :n]} for r, (k, n) in enumerate(
        [(1, 16), (2, 3), (1, 1), (1, 9), (2, 7), (1, 4), (1, 12)])]
    with BoundedProgram.load(out, cache_dir=serve_cache_dir) as program:
        outs = program.run_many(calls)
        assert sum(program.executions.values()) == 3        # 9 rows, at most 4 a body
        for i, (call, got) in enumerate(zip(calls, outs)):
            want = ref(call)
            for name in ("embedding", "hidden"):
                assert got[name].shape == want[name].shape
                assert_within(tol.relative_error(got[name], want[name]), _bound(m, name),
                              f"bounded embedder run_many call {i} {name}")


@pytest.mark.numeric
def test_the_two_bound_scorer_serves_its_in_process_results_at_every_bucket_edge(cross_setup, serve_cache_dir):
    m, out, params = cross_setup
    ref = _in_process(bmod.cross, params, bmod.cross_bounds())
    ex = bmod.cross_examples()
    with BoundedProgram.load(out, cache_dir=serve_cache_dir) as program:
        for nq, nd in bmod.sweep(bmod.edge_sizes((4, 8), 8), bmod.edge_sizes((8, 16, 32), 32)):
            call = {"query": ex["query"][:nq], "doc": ex["doc"][:nd]}
            got, ran = _ran(program, call)
            assert ran == [f"query{4 if nq <= 4 else 8}_doc{next(b for b in (8, 16, 32) if b >= nd)}"]
            want = ref(call)
            for name in ("attended", "doc_weight", "score"):
                assert got[name].shape == want[name].shape
                assert_within(tol.relative_error(got[name], want[name]), _bound(m, name),
                              f"bounded scorer {name} query={nq} doc={nd}")


@pytest.mark.numeric
def test_control_a_runtime_that_fills_every_mask_as_valid_is_caught(embed_setup, cross_setup, serve_cache_dir,
                                                                     monkeypatch):
    """The comparison above, with the valid masks and lengths of the bucket instead of the call's: one below an
    edge, the served results take the zero padding in and fail the bound; at the edge they still pass."""
    real = serve_bounded.valid_inputs

    def bucket_valid(bounds, bucket, calls):
        """Each length the bucket's size, each mask all True."""
        return [np.ones_like(a) if a.dtype == np.bool_ else np.full_like(a, bucket[b.name])
                for b, a in zip((b for b in bounds for _ in (0, 1)), real(bounds, bucket, calls))]

    monkeypatch.setattr(serve_bounded, "valid_inputs", bucket_valid)
    m, out, params = cross_setup
    ex = bmod.cross_examples()
    ref = _in_process(bmod.cross, params, bmod.cross_bounds())
    with BoundedProgram.load(out, cache_dir=serve_cache_dir) as program:
        for nq, nd, fails in ((3, 7, True), (7, 15, True), (4, 8, False)):
            call = {"query": ex["query"][:nq], "doc": ex["doc"][:nd]}
            got, want = program.run(call), ref(call)
            err = tol.relative_error(got["attended"], want["attended"])
            assert (err > _bound(m, "attended")) == fails, (nq, nd, err)
    m, out, params, ids = embed_setup
    ref = _in_process(bmod.embed, params, bmod.embed_bounds())
    with BoundedProgram.load(out, cache_dir=serve_cache_dir) as program:
        call = {"ids": ids[:3, :7]}
        got, want = program.run(call), ref(call)
        assert tol.relative_error(got["embedding"], want["embedding"]) > 100 * _bound(m, "embedding")


@pytest.mark.parametrize("control,output", list(bmod.EMBED_CONTROLS.items()))
def test_an_embedder_that_reads_padding_is_refused_by_name(control, output, tmp_path):
    params = bmod.embed_params(V, MAX_TOKENS)
    ids = np.random.default_rng(3).integers(0, V, (MAX_ROWS, MAX_TOKENS)).astype(np.int32)
    fn = lambda p, inputs, valid: bmod.embed(p, inputs, valid, control=control)   # noqa: E731
    with pytest.raises(ExportError, match=rf"output '{output}' reads padding: in bucket rows \d, tokens \d+ "
                                          r"\(program 'rows\d_tokens\d+'\), row \d of \d live rows with tokens \d+, "
                                          r"its padded result differs from its exact-size result by .* of its scale, "
                                          r"over the tolerance model's .* \(\d+ float32 roundings\); mask what lies"):
        tlaloc_jax.stage_bounded(fn, params, {"ids": ids}, tmp_path / "a", bounds=bmod.embed_bounds(), progress=False)
    assert not (tmp_path / "a").exists(), "a refused program must write nothing"


@pytest.mark.parametrize("control,output", list(bmod.CROSS_CONTROLS.items()))
def test_a_scorer_that_reads_padding_is_refused_by_name(control, output, tmp_path):
    fn = lambda p, inputs, valid: bmod.cross(p, inputs, valid, control=control)   # noqa: E731
    with pytest.raises(ExportError, match=rf"output '{output}' reads padding: in bucket query \d, doc \d+ "
                                          r"\(program 'query\d_doc\d+'\), the call with query \d, doc \d+"):
        tlaloc_jax.stage_bounded(fn, bmod.cross_params(), bmod.cross_examples(), tmp_path / "a",
                                 bounds=bmod.cross_bounds(), progress=False)


def test_each_runtime_refuses_the_other_kind_of_artifact_by_name(embed_setup, tmp_path):
    _, out, _, _ = embed_setup
    with pytest.raises(af.ManifestError, match=r"no tlaloc-serving.json in the artifact directory: it holds a "
                                               r"bounded program \(tlaloc-bounded.json\), not a decoder; load it with "
                                               r"tlaloc_jax.serve.BoundedProgram"):
        Engine.load(out, cache_dir=None)
    decoder = tmp_path / "decoder"
    decoder.mkdir()
    (decoder / af.MANIFEST_NAME).write_text("{}")
    with pytest.raises(af.ManifestError, match=r"no tlaloc-bounded.json in the artifact directory: it holds a decoder "
                                               r"\(tlaloc-serving.json\), not a bounded program; load it with "
                                               r"tlaloc_jax.serve.Engine"):
        BoundedProgram.load(decoder, cache_dir=None)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_every_file_and_body_is_checked_at_load(embed_setup, tmp_path):
    _, out, _, _ = embed_setup
    m = bm.load_bounded(out)
    p = m.programs[3]
    bad = _copy(out, tmp_path / "body")
    (bad / p.serialized).write_bytes((bad / p.serialized).read_bytes() + b" ")
    with pytest.raises(af.ManifestError, match=rf"program '{p.name}' serialized body .* has sha256"):
        bm.load_bounded(bad)
    bad = _copy(out, tmp_path / "weight")
    w = m.weights[0]
    data = bytearray((bad / w.file).read_bytes())
    data[0] ^= 1
    (bad / w.file).write_bytes(bytes(data))
    with pytest.raises(af.ManifestError, match=rf"weight '{w.slot}' file .* has sha256"):
        bm.load_bounded(bad)
    bm.load_bounded(bad, verify_weights=False)      # --trust-weights: sizes only
    # A body whose @main is another program's, its hash updated to match: the signature check catches it.
    bad = _copy(out, tmp_path / "main")
    raw = json.loads((bad / bm.BOUNDED_NAME).read_text())
    a, b = raw["programs"][0], raw["programs"][1]
    a["serialized"], a["serialized_sha256"] = b["serialized"], b["serialized_sha256"]
    (bad / bm.BOUNDED_NAME).write_text(json.dumps(raw))
    with pytest.raises(af.ManifestError, match=rf"program '{a['name']}' body .* does not match the manifest: "
                                               r"argument 0 \(INPUT ids\) is int32\[1, 8\] in the body, the manifest "
                                               r"says int32\[1, 4\]"):
        bm.load_bounded(bad)
    raw["programs"] = raw["programs"][1:]
    (bad / bm.BOUNDED_NAME).write_text(json.dumps(raw))
    with pytest.raises(af.ManifestError, match=r"no program for sizes \[1, 4\] of \['rows', 'tokens'\]"):
        bm.load_bounded(bad)


def test_a_bounded_file_unchanged_since_a_load_is_not_hashed_again(embed_setup, tmp_path, monkeypatch):
    """BoundedProgram (and the server's --embedding-artifact check) remember the files' sha256 in the cache
    directory as Engine.load does: a second load hashes none; a weight edited since, its size and modification
    time put back, is hashed again and refused by name. Control: without a cache directory every load hashes
    every file."""
    from tlaloc_jax.artifact import digests as digests_module
    _, out, _, _ = embed_setup
    art, cache = _copy(out, tmp_path / "art"), tmp_path / "cache"
    hashed = []

    def counting(path):
        hashed.append(path)
        return af.sha256_file(path)
    monkeypatch.setattr(digests_module, "sha256_file", counting)
    counts = []
    for cache_dir in (cache, cache, None, None):
        hashed.clear()
        af.load_remembering(bm.load_bounded, art, cache_dir)
        counts.append(len(hashed))
    m = bm.load_bounded(art)
    files = len(m.programs) + len(m.weights) + len(m.tokenizer_files)   # of the bodies, the bytecode alone
    assert counts == [files, 0, files, files], counts

    w = m.weights[0]
    path, before = art / w.file, (art / w.file).stat()
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(af.ManifestError, match=rf"weight '{w.slot}' file .* has sha256"):
        BoundedProgram.load(art, cache_dir=cache)


@pytest.mark.parametrize("call,message", [
    ({"ids": np.zeros((1, 17), np.int32)}, r"input 'ids' axis 1 \(bound 'tokens'\) is 17; it takes 1 to 16"),
    ({"ids": np.zeros((5, 3), np.int32)}, r"input 'ids' axis 0 \(bound 'rows'\) is 5; it takes 1 to 4"),
    ({"ids": np.zeros((1, 0), np.int32)}, r"input 'ids' axis 1 \(bound 'tokens'\) is 0; it takes 1 to 16"),
    ({"ids": np.zeros(3, np.int32)}, r"input 'ids' has 1 axes, the program takes 2 \(rows, tokens\)"),
    ({"ids": np.zeros((1, 3), np.float32)}, r"input 'ids' is float32, the program takes int32"),
    ({"ids": np.full((1, 3), 2**40)}, r"input 'ids' holds values outside int32"),
    ({"tokens": np.zeros((1, 3), np.int32)}, r"the program takes inputs \['ids'\]; the call lacks \['ids'\]"),
])
def test_a_call_the_program_cannot_run_is_refused_by_name(embed_setup, serve_cache_dir, call, message):
    with BoundedProgram.load(embed_setup[1], cache_dir=serve_cache_dir) as program:
        with pytest.raises(CallRefused, match=message):
            program.run_many([{"ids": np.zeros((1, 2), np.int32)}, call])
        assert program.executions == {}, "a refused call runs nothing, nor the calls beside it"


def test_two_axes_of_one_bound_must_agree(tmp_path):
    """Two inputs on one bound: a call whose sizes differ is refused, naming both."""
    params = {"wq": bmod.cross_params()["wq"]}
    ex = {"a": np.ones((8, bmod.F), np.float32), "b": np.ones((8, bmod.F), np.float32)}
    bounds = {"n": tlaloc_jax.Bound(max=8, axes=[("a", 0), ("b", 0)], buckets=(8,))}
    out = tmp_path / "two"
    tlaloc_jax.stage_bounded(lambda p, x, v: {"y": x["a"] @ p["wq"] + x["b"]}, params, ex, out, bounds=bounds,
                             progress=False)
    with BoundedProgram.load(out, cache_dir=None) as program:
        with pytest.raises(CallRefused, match=r"input 'b' axis 0 is 3, but input 'a' axis 0 is 5: both are bound 'n'"):
            program.run({"a": ex["a"][:5], "b": ex["b"][:3]})


@pytest.mark.parametrize("case,message", [
    ("not_at_max", r"input 'ids' axis 1 is 12 in example_args; give the example at the max 16 of bound 'tokens'"),
    ("output_twice_the_bound", r"output 'twice' axis 1 is 32 with bound 'tokens' at 16 and 16 at 8; an output axis "
                               r"has one bound's size or a fixed one"),
    ("unused_weight", r"the function never reads weights \['unused'\]"),
    ("while_loop", r"lax.while_loop, whose trip count is known only at run time"),
    ("two_batch_bounds", r"bounds \['rows', 'tokens'\] are all batch bounds"),
    ("buckets_below_max", r"bound 'tokens': buckets \[4, 8\] must lie in \[1, 16\] and end at its max 16"),
    ("embedding_output_per_token", r"embedding: output 'hidden' is float32 with axes \['rows', 'tokens', ''\]"),
])
def test_stage_bounded_refuses_what_it_cannot_serve_by_name(case, message, tmp_path):
    params = bmod.embed_params(V, MAX_TOKENS)
    ids = np.random.default_rng(3).integers(0, V, (MAX_ROWS, MAX_TOKENS)).astype(np.int32)
    bounds, fn, kw = bmod.embed_bounds(), bmod.embed, {}
    if case == "not_at_max":
        ids = ids[:, :12]
    elif case == "output_twice_the_bound":
        fn = lambda p, x, v: {**bmod.embed(p, x, v), "twice": jnp.concatenate([x["ids"], x["ids"]], 1)}  # noqa: E731
    elif case == "unused_weight":
        params = {**params, "unused": np.ones(3, np.float32)}
    elif case == "while_loop":
        fn = lambda p, x, v: {"e": lax.while_loop(lambda c: c[0] < v["tokens"].length[0],    # noqa: E731
                                                  lambda c: (c[0] + 1, c[1] * 0.5),
                                                  (0, bmod.embed(p, x, v)["embedding"]))[1]}
    elif case == "two_batch_bounds":
        bounds["tokens"] = tlaloc_jax.Bound(max=16, axes=[("ids", 1)], batch=True)
    elif case == "buckets_below_max":
        bounds["tokens"] = tlaloc_jax.Bound(max=16, axes=[("ids", 1)], buckets=(4, 8))
    elif case == "embedding_output_per_token":
        kw = dict(embedding=tlaloc_jax.EmbeddingTask("ids", "hidden", V))
    with pytest.raises(ExportError, match=message):
        tlaloc_jax.stage_bounded(fn, params, {"ids": ids}, tmp_path / "a", bounds=bounds, progress=False, **kw)


def test_the_same_program_gives_the_same_bytes(cross_setup, tmp_path):
    _, out, params = cross_setup
    again = tmp_path / "again"
    tlaloc_jax.stage_bounded(bmod.cross, params, bmod.cross_examples(), again, bounds=bmod.cross_bounds(),
                             name="scorer", progress=False)
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for f in files:
        assert (out / f).read_bytes() == (again / f).read_bytes(), f
