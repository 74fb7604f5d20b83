"""Watching what the scheduler runs: each step's calls recorded as the test describes them, a run of some
sequences decoding when others arrive, running an engine's sequences to their end; and the plugin's compiles
counted."""

from __future__ import annotations


def record_calls(eng, monkeypatch, describe) -> list[list]:
    """A list that gets, for every step the engine's scheduler plans from now on, [describe(call) for its calls]."""
    steps: list[list] = []
    real = eng.scheduler.schedule

    def spy():
        step = real()
        steps.append([describe(c) for c in step.calls])
        return step
    monkeypatch.setattr(eng.scheduler, "schedule", spy)
    return steps


def decode_then_arrive(eng, decoding, arriving, steps: list[list], max_new_tokens: int = 6):
    """`decoding` prompts read in one step, then `arriving` prompts queued, all run to the end: (the ids of all, the
    calls of the step that starts the new ones, from `steps` of record_calls)."""
    rids = [eng.add_request(p, max_new_tokens) for p in decoding]
    eng.step()
    rids += [eng.add_request(p, max_new_tokens) for p in arriving]
    steps.clear()
    return run_out(eng, rids), steps[0]


def run_out(eng, rids: list[str]) -> list[list[int]]:
    """Step the engine until every sequence has finished; the ids of `rids`, which are then released."""
    while eng.has_unfinished():
        eng.step()
    out = [eng.output(r) for r in rids]
    for r in rids:
        eng.release(r)
    return out


def count_compiles(monkeypatch) -> dict[str, int]:
    """{"compile": n}, n counting every pypjrt compile in this process from now on (a compile-cache hit is none)."""
    import pypjrt
    counts = {"compile": 0}
    real = pypjrt.Client.compile

    def counted(self, *args, **kw):
        counts["compile"] += 1
        return real(self, *args, **kw)
    monkeypatch.setattr(pypjrt.Client, "compile", counted)
    return counts
