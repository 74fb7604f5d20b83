"""The vLLM plugin's door into the runtime (serve/integrations/vllm/runtime.py), without vLLM: rows of (token ids,
start, pages) on pages the caller chose, as vLLM's block manager hands them out, give Engine.generate's ids."""

from __future__ import annotations

import pytest

from tlaloc_jax import artifact as af
from tlaloc_jax.serve import Engine, Sampling
from tlaloc_jax.serve.integrations.vllm.runtime import ArtifactRuntime, Row

PROMPT = [5, 17, 99, 3, 250, 8, 61, 9, 12, 40, 41, 42, 43, 7, 1, 2, 3, 4, 5, 6]      # 20 tokens: 3 pages of 8
NEW = 10
PAGES = [41, 3, 17, 60, 8, 22, 35, 50, 12]       # scattered, none of them page 0


def _generate(rt: ArtifactRuntime, pages: list[int], sampling: Sampling | None = None, seed: int = 0,
              decode_pages: list[int] | None = None) -> list[int]:
    """Read the prompt in two pieces (16 + 4: the artifact's prefill chunk is 16), then decode one token a call
    (on `decode_pages` when given: the control)."""
    tokens, out = list(PROMPT), []
    pieces = [(0, 16), (16, len(PROMPT))]
    while len(out) < NEW:
        if pieces:
            a, b = pieces.pop(0)
            kind, ids, start = af.EntryKind.PREFILL, tokens[a:b], a
            produces = b == len(PROMPT)
        else:
            kind, ids, start, produces = af.EntryKind.DECODE, tokens[-1:], len(tokens) - 1, True
            pages = decode_pages or pages
        entry = rt.pick(kind, 1, start + len(ids), len(ids))
        row = Row(ids, start, pages, sampling=sampling if produces else None, seed=seed, prompt=PROMPT,
                  generated=out)
        tok = int(rt.run(entry, [row]).tokens[0])
        if produces:
            out.append(tok)
            tokens.append(tok)
    return out


@pytest.fixture(scope="module")
def artifact(http_artifacts):
    return http_artifacts[1]


def test_rows_on_scattered_pages_give_engine_ids(artifact, serve_cache_dir):
    with Engine.load(artifact, cache_dir=serve_cache_dir, progress=False) as eng:
        want = eng.generate([PROMPT], NEW)[0]
    rt = ArtifactRuntime(artifact, cache_dir=serve_cache_dir)
    try:
        assert rt.sampler is None and rt.block_size == 8
        assert _generate(rt, PAGES, Sampling()) == want
        # The control: decode calls that read the prompt's pages in another order than its prefill wrote them part
        # from the Engine's ids.
        assert _generate(rt, PAGES, Sampling(), decode_pages=PAGES[1:3] + PAGES[:1] + PAGES[3:]) != want
    finally:
        rt.close()


@pytest.mark.slow          # exports and compiles an artifact of its own (~11 s); make test-vllm runs it
def test_in_body_sampler_draws_the_engine_stream(tmp_path, serve_cache_dir):
    """With the sampler in the entries, a seeded row draws what Engine.generate draws for the same seed."""
    from hf_models import build_checkpoint
    from tlaloc_jax.export import Sampler, export_checkpoint
    ck = build_checkpoint(tmp_path / "ck", "llama", seed=3)
    export_checkpoint(ck, tmp_path / "art", batch_ladder=(1,), context_ladder=(32,), block_size=8, prefill_chunk=16,
                      prefill_long_chunk=0,
                      num_blocks=12, progress=False, sampler=Sampler())
    s = Sampling(temperature=0.9, top_k=30, seed=11, repetition_penalty=1.2)
    with Engine.load(tmp_path / "art", cache_dir=serve_cache_dir, progress=False) as eng:
        want = eng.generate([PROMPT], NEW, sampling=s)[0]
    rt = ArtifactRuntime(tmp_path / "art", cache_dir=serve_cache_dir)
    try:
        assert rt.sampler is not None
        pages = [9, 2, 7, 11]                        # the pool holds 12 pages
        assert _generate(rt, pages, s, seed=11) == want
        assert _generate(rt, pages, s, seed=12) != want     # the control: another seed draws another stream
    finally:
        rt.close()
