"""The artifact's own compile cache: its entries compiled at export, shipped in `<artifact>/compile-cache/`.

A first start on a host like the export's then deserializes every entry instead of compiling it (a cold start
becomes a warm one). `index.json` records what the executables were compiled under: the plugin (its package,
size and what it says of itself), the XLA flags, the host CPU's model and features and the native kernel variants
the entries call. A server uses the folder only where all of these equal its own; otherwise it logs one line
naming what differs and compiles, as without it. Each file is checked again at load (its body, its facts and the
executable's sha256, compile_cache.CompileCache.read): a damaged or misplaced file is logged and compiled over,
never run. The user's compile cache still comes first, and a compile here is stored there, not in the artifact.

    python -m tlaloc_jax.serve.runtime.shipped_cache ARTIFACT_DIR [--processes N]   # the exporter's last step
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import pypjrt

from .compile_cache import CompileCache, facts, facts_identity

log = logging.getLogger("tlaloc_jax.serve")

FOLDER = "compile-cache"
INDEX = "index.json"
FORMAT = 1


class ShippedCache:
    """The artifact's compile cache, read only, for a device whose facts matched its index."""

    def __init__(self, directory: Path, identity: str):
        self.directory = directory
        self._cache = CompileCache(directory, identity)

    def holds(self, digest: str, options: bytes, checked: bool = True) -> bool:
        """Whether the body's executable is here and passes its check (checked=False: is here, unread)."""
        key = self._cache.key(digest, options)
        return self._cache.read(key, digest)[0] is not None if checked else self._cache.has(key)

    def load(self, client: pypjrt.Client, digest: str, options: bytes, label: str, deserialize=None):
        """The loaded executable, or None (not here, or here but failing its check: logged, to compile)."""
        handle, status = self._cache.load(client, self._cache.key(digest, options), digest, deserialize)
        if status == "stale":
            log.warning("the artifact's compiled %s (%s) fails its check (damaged, or not this body's): compiling "
                        "it instead", label, self.directory)
        return handle


def open_shipped(artifact_dir: str | os.PathLike[str], device, custom_calls) -> ShippedCache | None:
    """The artifact's compile cache where its index matches this device and host, else None: no folder (silently),
    or one line saying what differs (another CPU, plugin, XLA flags ...) and that entries compile here."""
    folder = Path(artifact_dir) / FOLDER
    if not (folder / INDEX).is_file():
        return None
    try:
        index = json.loads((folder / INDEX).read_text())
        shipped = index["facts"] if index.get("format") == FORMAT else None
    except (OSError, ValueError, KeyError, TypeError):
        shipped = None
    if not isinstance(shipped, dict):
        log.warning("%s is unreadable: compiling the entries here", folder / INDEX)
        return None
    differ = differences(facts(device, custom_calls), shipped)
    if differ:
        log.warning("the artifact's compiled entries (%s) were compiled for another %s: compiling them here "
                    "(re-export on this host to ship matching ones)", folder, ", ".join(differ))
        return None
    # The index's identity, which the files were stored under: the check above is what keeps them off other hosts.
    return ShippedCache(folder, facts_identity(shipped))


def differences(here: dict, shipped: dict) -> list[str]:
    """The facts (keys) on which this host differs from the one that compiled the shipped entries."""
    return sorted(k for k in here.keys() | shipped.keys() if here.get(k) != shipped.get(k))


def fill(artifact_dir: str | os.PathLike[str], plugin: str | None = None,
         processes: int | None = None) -> tuple[int, float]:
    """Compile every entry of the artifact with this host's plugin into `<artifact>/compile-cache/` and write its
    index. The compiles run in `processes` worker processes (at most, and by default, one a core), never here: the
    index's facts are the workers' own, who must all report the same (a process's facts depend on what it loaded
    first, such as a native kernel's variant). -> (entries compiled, seconds). Raises WorkerError naming a failed entry or the facts
    on which workers differ; the index is then not written."""
    from tlaloc_jax import artifact as af

    from . import compile_workers

    art = Path(artifact_dir)
    m = af.load_manifest(art, verify_weights=False)
    folder = art / FOLDER
    t0 = time.perf_counter()
    entries = [(e.name, str(art / e.serialized)) for e in m.entries]
    work = compile_workers.start(entries, folder, plugin=plugin, devices=m.devices,
                                 custom_calls=list(m.versions.custom_calls), shipped=True,
                                 processes=min(processes or compile_workers.cores(), compile_workers.cores()))
    work.wait()
    for name, _ in entries:
        work.done[name].result()            # raises the first failure, by name
    here = work.facts[0]["facts"]
    for other in work.facts[1:]:
        if differ := differences(here, other["facts"]):
            raise compile_workers.WorkerError(
                f"the compile workers (processes {work.facts[0]['pid']} and {other['pid']}) report different "
                f"{', '.join(differ)}: their executables cannot share one index")
    # The index last: a folder without one (an export stopped part way) is not used.
    (folder / INDEX).write_text(json.dumps({"format": FORMAT, "facts": here}, indent=1, sort_keys=True) + "\n")
    return len(m.entries), time.perf_counter() - t0


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tlaloc_jax.serve.runtime.shipped_cache",
                                 description="Compile an artifact's entries on this host into <artifact>/" + FOLDER
                                             + ", so a server on a host like it starts without compiling.")
    ap.add_argument("artifact")
    ap.add_argument("--plugin", default=None, help="PJRT plugin .so (default: the installed one)")
    ap.add_argument("--processes", type=int, default=None,
                    help="compile worker processes (default and most: one a core; at most one an entry)")
    a = ap.parse_args(argv)
    if a.processes is not None and a.processes < 1:
        ap.error(f"--processes must be at least 1, got {a.processes}")
    from .compile_workers import WorkerError
    try:
        n, seconds = fill(a.artifact, a.plugin, a.processes)
    except WorkerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from .compile_workers import cores
    procs = min(a.processes or cores(), cores(), n)
    print(f"compiled {n} entries into {Path(a.artifact) / FOLDER} in {seconds:.1f} s ({procs} process{'es' if procs > 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
