"""Compile entries in worker processes, each with its own PJRT client, into a compile cache folder.

XLA's CPU compile of one body is mostly one thread and pypjrt holds a process-wide lock around a compile, so one
process compiles one entry at a time; N processes on N cores compile N. Each worker loads the plugin, registers the
native kernels, says what it compiled under (compile_cache.facts and the Device's identity) and then, entry by entry,
compiles and stores the executable (CompileCache.store: a temporary file renamed into place). The callers:
shipped_cache.fill (the export's compile-cache/) and Runner's preload (a server's cache misses). CPU plugin only.

    python -m tlaloc_jax.serve.runtime.compile_workers     # a worker: its job as JSON on stdin, reports on stdout
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from tlaloc_jax import native

log = logging.getLogger("tlaloc_jax.serve")


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def shares(entries: list[tuple[str, str]], n: int) -> list[list[tuple[str, str]]]:
    """`entries` ((name, body path), in order) dealt to n workers, largest body first in turn, so that the big ones
    spread; each share keeps the given order (a server's progress follows the manifest)."""
    order = {e: i for i, e in enumerate(entries)}
    out: list[list[tuple[str, str]]] = [[] for _ in range(n)]
    for i, e in enumerate(sorted(entries, key=lambda e: -os.path.getsize(e[1]))):
        out[i % n].append(e)
    return [sorted(s, key=order.__getitem__) for s in out if s]


class WorkerError(RuntimeError):
    """A compile worker failed; the message names the worker or the entry and says why."""


@dataclass
class Workers:
    """Compile workers under way. `done[name]`: a future that resolves to the entry's compile seconds once its
    executable is stored, or raises WorkerError naming why it is not. `facts`: each worker's report of what it
    compiled under ({"facts": ..., "identity": ...}), once it gave one."""
    done: dict[str, Future]
    facts: list[dict] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def wait(self) -> None:
        for t in self.threads:
            t.join()

    def stop(self) -> None:
        """Kill the workers still running (a server that closes during its start) and wait for them."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        self.wait()


def start(entries: list[tuple[str, str]], cache_dir: str | os.PathLike[str], *, plugin: str | None, devices: int,
          custom_calls: list[str], processes: int, shipped: bool) -> Workers:
    """Start min(processes, entries) workers compiling `entries` ((name, body path)) into `cache_dir`, stored under
    the identity of the shipped cache's facts (`shipped`) or of the Device's own (a server's compile cache)."""
    n = max(1, min(processes, len(entries)))
    work = Workers({name: Future() for name, _ in entries})
    for share in shares(entries, n):
        job = dict(entries=share, cache_dir=str(cache_dir), plugin=plugin, devices=devices,
                   custom_calls=list(custom_calls), shipped=shipped)
        err = tempfile.TemporaryFile()
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, env=dict(os.environ, PYTHONUNBUFFERED="1", **native.loaded_variant_env()))
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
        work.procs.append(proc)
        t = threading.Thread(target=_follow, args=(proc, err, [name for name, _ in share], work),
                             name="tlaloc-compile-worker", daemon=True)
        t.start()
        work.threads.append(t)
    return work


def _follow(proc: subprocess.Popen, err, names: list[str], work: Workers) -> None:
    """Read one worker's reports, resolving its entries' futures; those it never reported fail with its exit."""
    for line in proc.stdout:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if "facts" in msg:
            work.facts.append(msg)
        elif (fut := work.done.get(msg.get("entry"))) is not None and not fut.done():
            if "error" in msg:
                fut.set_exception(WorkerError(f"compiling {msg['entry']} in a worker failed: {msg['error']}"))
            else:
                fut.set_result(msg["seconds"])
    code = proc.wait()
    err.seek(0)
    tail = (err.read().decode(errors="replace").strip().splitlines() or ["no output"])[-1]
    err.close()
    for name in names:
        if not work.done[name].done():
            work.done[name].set_exception(WorkerError(f"the compile worker for {name} exited ({code}) before it: "
                                                      f"{tail}"))


def _work(job: dict, report) -> None:
    """The worker: compile the job's entries into its cache folder, reporting each."""
    import hashlib

    from .compile_cache import CompileCache, facts, facts_identity
    from .pjrt import Device

    with Device(job["plugin"], devices=job["devices"]) as device:
        for target in job["custom_calls"]:
            device.register_native(target)
        here = facts(device, job["custom_calls"])
        identity = facts_identity(here) if job["shipped"] else device.identity
        report({"facts": here, "identity": identity, "pid": os.getpid()})
        cache = CompileCache(job["cache_dir"], identity)
        for name, path in job["entries"]:
            t0 = time.perf_counter()
            try:
                code = Path(path).read_bytes()
                exe = device.compile(code, name=name)
            except Exception as e:  # noqa: BLE001 - reported by name; fill then fails, a server compiles it itself
                report({"entry": name, "error": f"{type(e).__name__}: {e}"})
                continue
            digest, options = hashlib.sha256(code).hexdigest(), device.compile_options_bytes(code)
            key = cache.key(digest, options)
            cache.store(key, exe.handle, digest, options, name)
            exe.close()
            if cache.has(key):
                report({"entry": name, "seconds": time.perf_counter() - t0})
            else:               # store never fails a compile; here the file is the result
                report({"entry": name, "error": f"its executable could not be written into {job['cache_dir']}"})


def main() -> int:
    job = json.loads(sys.stdin.read())
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)               # what the plugin prints goes to stderr, never into the reports
    def report(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()
    _work(job, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
