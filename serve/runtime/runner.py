"""The artifact on the device: compiled entries, weights uploaded once, pools donated to every run.

`Runner` knows entries by kind and inputs by role, never a model: `run(entry, inputs, want)` assembles the
entry's arguments in signature order (step and sampler inputs from the caller, pools and weights it holds),
runs it with the pools donated, checks that they were updated in place, and pulls the wanted outputs.
Scheduling, sampling and requests are the engine's; the vLLM worker and the benches use this directly.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import enum
import logging
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from tlaloc_jax import artifact as af
from tlaloc_jax import native

from . import compile_workers, host_memory, sharded
from .adapters import AdapterBuffers, adapter_bytes
from .handles import Buffer, Executable
from .loader import Loader
from .pjrt import Device
from .shipped_cache import open_shipped

log = logging.getLogger("tlaloc_jax.serve")

#: Every run of an entry until this many runs, and the first run of each entry after, has its pools'
#: addresses checked (a pool that moved was copied, not donated).
ADDRESS_CHECK_RUNS = 100
# The entries load at start on a thread a core (loader.py): the CPU plugin's loads, outside pypjrt's lock, run side by
# side. Those a server does not wait for load at nice 19, in the time its steps leave idle.


class _ArgSource(enum.Enum):
    """Where an entry's argument comes from."""
    STEP = "step input"
    POOL = "pool"
    WEIGHT = "weight"
    ADAPTER = "adapter"


class Runner:
    """One artifact on one PJRT device, or on the N devices of its mesh (a tensor-parallel artifact: each argument
    then a tuple of N buffers, serve/runtime/sharded.py, and one execution a call for all of them). Not
    thread-safe: one caller runs entries."""

    def __init__(self, artifact_dir: str | Path, manifest: af.Manifest, device: Device, *, progress: bool = True,
                 donate: bool = True, weight_arena: bool = True, preload: bool = False,
                 compile_processes: int | None = None, ready_first: Sequence[str] | None = None):
        """Check the device has room, compile one entry of each kind (the others on first use, _compile_kinds),
        upload the weights and allocate zeroed pools. Closes the device if any of it fails. A device of another
        device count than the artifact's mesh is refused by name before anything is compiled or allocated.

        donate: False runs the pools as plain inputs (a test control: each run then copies them).
        weight_arena: False serves the weights from their files' mappings (sharded.upload_weights' arena).
        preload: instead, every entry loads from the compile cache (or compiles) in a background thread while the
        weights are read, `ready_first` (entry names; None: all) and those in neither compile cache first: `loading()`
        lists those for a server to wait on before it is ready (loop.py), the others load while it serves (`loaded`
        says which have), and `executable` waits for its entry's. Entries in neither compile cache compile meanwhile
        in worker processes into the device's cache (at most `compile_processes`, default one a core:
        _compile_in_workers)."""
        self.artifact_dir = Path(artifact_dir)
        self.manifest = m = manifest
        self.device = device
        self.donate = donate
        self.executables: dict[str, Executable] = {}
        self._neutral: dict[tuple[str, af.Role], sharded.Placed] = {}
        # The last host value of each (entry, input role) and its device buffer: an input equal to the previous
        # call's (block tables, seeds, stop ids, ...) is not uploaded again.
        self._kept_inputs: dict[tuple[str, str], tuple[bytes, sharded.Placed]] = {}
        self._arg_plans: dict[str, list[tuple[_ArgSource, object, af.Role]]] = {}
        self._entries_checked: set[str] = set()
        self._deferred: dict[str, str] = {}  # entry -> "cached" | "pending": ready on first use (_compile_kinds)
        self._loading: dict[str, cf.Future] = {}    # entry -> its executable, being loaded (preload)
        self._before_ready: set[str] = set()        # the preloaded entries a server waits for (loading())
        self._arena: cf.Future | None = None        # the weights read into huge pages in the background (preload)
        self._loader: Loader | None = None
        self._workers: compile_workers.Workers | None = None     # compiling cache misses (preload)
        self._closing = False
        self._worker_miss_told = False
        self.compile_processes = compile_processes
        self.stats = dict(executions=0, warm_ups=0, pool_address_checks=0, pool_in_place=0, executions_by_entry={},
                          inputs_uploaded=0, inputs_overwritten=0)
        self._driver = threading.Lock()     # held by the thread running entries (driving)
        self._driver_name = ""
        try:
            want = {"cpu": "cpu", "cuda": "cuda"}[m.versions.platform]
            if device.platform_name.lower() not in (want, "gpu" if want == "cuda" else want):
                raise af.ManifestError(f"artifact was exported for {m.versions.platform}, the plugin "
                                       f"{device.plugin_path} is {device.platform_name}")
            if device.devices != m.devices:
                raise af.ManifestError(sharded.device_count_mismatch(m, device.devices))
            missing = {}
            for target in m.versions.custom_calls:     # before any body that calls them compiles
                try:
                    device.register_native(target)
                except native.NativeKernelError as e:
                    missing[target] = e
            if missing:                                # one error naming them all
                raise native.unavailable(m.versions.custom_calls, missing)
            device.shipped = open_shipped(self.artifact_dir, device, m.versions.custom_calls)
            self._check_memory()
            if preload:
                self._preload(ready_first)
            else:
                self._compile_kinds(progress)
            self.resident_before_weights = host_memory.resident_bytes()   # the runtime's own: plugin, entries
            # Preloading, the weights serve from their files' mappings at once and move to huge pages in the
            # background once the entries have loaded (the arena's page faults would hold up the loads): _take_arena.
            late = preload and weight_arena and device.host_memory and sharded.arena_pays(m.weights, m.mesh)
            self.weights = sharded.upload_weights(device, self.artifact_dir, m.weights, m.mesh,
                                                  weight_arena and not late)
            self._arena = self._loader.submit("weights", sharded.read_weights, self.artifact_dir, m.weights, m.mesh,
                                              True, lambda: self._closing) if late else None
            self.pools: dict[str, sharded.Placed] = {p.name: sharded.zeros(device, p.dtype, p.shape, p.partition,
                                                                           m.mesh) for p in m.pools}
            # The LoRA slots (manifest `lora`), zeroed: written as adapters are loaded (serve/lora_slots.py).
            self.adapters = AdapterBuffers(device, m.lora) if m.lora is not None else None
        except BaseException:
            self._stop_loading()
            device.close()
            raise

    # -- loading -------------------------------------------------------------------------------------

    def _compile_kinds(self, progress: bool) -> None:
        """Compile at load one entry of each kind (the first; its siblings are the same body at other shapes), so a
        body this plugin refuses is refused at load. The other entries compile, or load from the compile cache (a
        quarter second an entry on a 2-core CPU, against seconds to compile), on first use: a start serves once its
        first request's entries are ready, and a server readies the rest while idle (Engine.warm_up). An entry in
        the cache stands for its kind (it compiled here before). The scoring prefills, which only requests for
        prompt logprobs run, are compiled on first use too."""
        from tqdm.auto import tqdm
        entries = [e for e in self.manifest.entries if e.kind != af.EntryKind.PREFILL_SCORED]
        bar = tqdm(entries, desc="compile", unit="entry", disable=not progress)
        proven: set[af.EntryKind] = set()
        for e in bar:
            bar.set_postfix_str(e.name)
            if self.device.compiled_before(self._body(e)):
                self._deferred[e.name] = "cached"
            elif e.kind in proven:
                self._deferred[e.name] = "pending"
            else:
                self.executable(e)
            proven.add(e.kind)

    def _preload(self, first: Sequence[str] | None) -> None:
        """Start loading every entry in the background while the weights are read (the calls release the GIL and run
        without pypjrt's lock, Device.compile's concurrent, so the weights' uploads do not wait behind a load): `first`
        and the entries in neither compile cache urgently, the others at the lowest priority (loader.py), each in the
        manifest's order. A cache file is read and checked once, by its load."""
        entries = self.manifest.entries
        misses = [e for e in entries if not self.device.compiled_before(self._body(e), checked=False)]
        self._workers = self._compile_in_workers(misses)
        self._before_ready = {e.name for e in misses} | (set(first) if first is not None else {e.name for e in entries})
        self._loader = Loader("tlaloc-load", threads=compile_workers.cores())
        for e in entries:
            self._loading[e.name] = self._loader.submit(e.name, self._load, e, urgent=e.name in self._before_ready)

    def _compile_in_workers(self, misses: list[af.Entry]) -> compile_workers.Workers | None:
        """Start compiling the entries in neither compile cache (`misses`) in worker processes into the device's cache,
        which the loads then read as hits (a process compiles one entry at a time: N of them on N cores compile N).
        None where there is no cache, the plugin is not the CPU's, or fewer than two workers would run (one gains
        nothing over the loader's own compile)."""
        folder = self.device.cache_directory
        if folder is None or not self.device.host_memory:
            return None
        missing = [(e.name, str(self.artifact_dir / e.serialized)) for e in misses]
        n = min(self.compile_processes or compile_workers.cores(), compile_workers.cores(), len(missing))
        if n < 2:
            return None
        log.info("compiling %d entries in %d worker processes into %s", len(missing), n, folder)
        return compile_workers.start(missing, folder, plugin=str(self.device.plugin_path), devices=self.device.devices,
                                     custom_calls=list(self.manifest.versions.custom_calls), processes=n,
                                     shipped=False)

    def _load(self, e: af.Entry) -> Executable:
        """The entry's executable: once a worker compiling it is done, from the cache (a failed worker: compiled here,
        where it fails as without workers, by name)."""
        done = self._workers.done.get(e.name) if self._workers is not None else None
        if done is not None:
            try:
                done.result()
            except compile_workers.WorkerError as err:
                if not self._closing:
                    log.warning("%s: compiling it here", err)
            if self._closing:
                raise RuntimeError(f"the runner closed while {e.name} was compiling")
        exe = self.device.compile(self._body(e), name=e.name, concurrent=True)
        if done is not None and done.exception() is None and exe.cache != "hit" and not self._worker_miss_told:
            self._worker_miss_told = True       # once: a worker of another identity misses every entry
            log.warning("%s compiled in a worker is not in %s as this process's (another identity?): compiled here",
                        e.name, self.device.cache_directory)
        return exe

    def _take_arena(self) -> None:
        """Serve the weights from the huge-page arena their background read filled (between runs: the buffers over
        their files' mappings are closed)."""
        future, self._arena = self._arena, None
        try:
            arrays = future.result()
        except Exception as err:  # noqa: BLE001 - the mappings serve on
            log.warning("reading the weights into huge pages failed (%s): they serve from their files", err)
            return
        old, self.weights = self.weights, sharded.adopt_weights(self.device, self.manifest.weights, arrays)
        for placed in old.values():
            sharded.close(placed)
        log.info("the weights serve from huge pages")

    def loading(self) -> list[tuple[af.Entry, cf.Future]]:
        """The entries a server waits for before it is ready (preload's first ones and those in neither compile cache)
        still loading in the background, with their futures, in the manifest's order."""
        return [(e, self._loading[e.name]) for e in self.manifest.entries
                if e.name in self._loading and e.name in self._before_ready]

    def background(self) -> list[tuple[str | None, cf.Future]]:
        """What still loads in the background beside `loading()`: the other entries by name, then the weights' read
        into huge pages (None)."""
        rest = [(e.name, self._loading[e.name]) for e in self.manifest.entries
                if e.name in self._loading and e.name not in self._before_ready and not self._loading[e.name].done()]
        return rest + ([(None, self._arena)] if self._arena is not None and not self._arena.done() else [])

    def loaded(self, e: af.Entry) -> bool:
        """Whether entry `e` runs without waiting for its background load (one that failed compiles on first use)."""
        future = self._loading.get(e.name)
        return future is None or future.done()

    def hurry(self, e: af.Entry) -> None:
        """Load entry `e` next, if its background load has not started (a call would take it, were it loaded)."""
        if self._loader is not None and not self.loaded(e):
            self._loader.hurry(e.name)

    def still_loading(self) -> int:
        """How many entries still load in the background (preload)."""
        return sum(not f.done() for f in self._loading.values())

    def _stop_loading(self) -> None:
        """Drop the loads not started, kill the compile workers, wait for the load under way (a plugin call cannot be
        interrupted; one waiting for a worker ends)."""
        self._closing = True
        if self._loader is not None:
            self._loader.cancel()
        if self._workers is not None:
            self._workers.stop()
        if self._loader is not None:
            self._loader.join()
            self._loader = None

    def to_compile(self) -> list[af.Entry]:
        """The entries neither compiled nor in the compile cache, in the manifest's order: what a server compiles
        before it is ready. A cached entry loads (deserializes, 0.1-0.2 s on a 2-core CPU) on first use or while
        the server is idle, as an entry's first run does."""
        def cached(e: af.Entry) -> bool:
            how = self._deferred.get(e.name)
            return how == "cached" or (how is None and self.device.compiled_before(self._body(e)))
        return [e for e in self.manifest.entries
                if e.name not in self.executables and e.name not in self._loading and not cached(e)]

    def _body(self, e: af.Entry) -> bytes:
        return (self.artifact_dir / e.serialized).read_bytes()

    def executable(self, e: af.Entry) -> Executable:
        """The entry's executable, compiled (or loaded from the compile cache) on first use."""
        exe = self.executables.get(e.name)
        if exe is None and (loading := self._loading.pop(e.name, None)) is not None:
            try:
                exe = self.executables[e.name] = loading.result()
            except Exception as err:  # noqa: BLE001 - compiled again below, which raises by name if it fails again
                log.warning("loading %s in the background failed (%s): compiling it now", e.name, err)
        if exe is None:
            t0 = time.perf_counter()
            exe = self.device.compile(self._body(e), name=e.name)
            self.executables[e.name] = exe
            self._deferred.pop(e.name, None)
            if e.kind == af.EntryKind.PREFILL_SCORED:
                log.info("compiled %s on first use (%s), %.1f s", e.name, exe.cache, time.perf_counter() - t0)
        return exe

    def _check_memory(self) -> None:
        """Refuse an artifact whose weights and pools cannot fit the device's free memory, before any of it is
        allocated (on a mesh, each device's share against each device's memory; the CPU plugin's devices share
        the host's, which must hold them all)."""
        weights, pools = sharded.bytes_per_device(self.manifest)
        weights += adapter_bytes(self.manifest.lora)
        shared = self.device.platform_name.lower() == "cpu"
        copies = self.device.devices if shared else 1
        need = (weights + pools) * copies
        each = not shared and self.device.devices > 1
        frees = [self.device.memory_available(d) for d in range(self.device.devices)] if each else \
            [self.device.memory_available()]
        for d, free in enumerate(frees):
            if free is not None and need > free:
                names = ", ".join(f"{p.name} {p.nbytes / 2**20:.1f} MiB" for p in self.manifest.pools)
                where = f"device {d}" if each else "the device"
                source = " (MemAvailable)" if shared else ""
                raise af.ManifestError(
                    f"the artifact {self.artifact_dir} needs {need / 2**20:.1f} MiB on {where} (weights "
                    f"{weights * copies / 2**20:.1f} MiB; pools {names}), and {self.device.platform_name} has "
                    f"{free / 2**20:.1f} MiB free{source}: nothing was allocated. Free memory, or export it smaller: "
                    "fewer KV pages (--num-blocks), a shorter --context-ladder, or quantized weights "
                    "(--weight-quant int8 or int4)")

    def compile_report(self) -> dict[str, int]:
        """How the entries were obtained: {"hit": n, "miss": n, ...} (hit: loaded from the disk cache, miss:
        compiled), and those still to be on first use: "cached" (in the disk cache), "pending" (to compile), or loading in
        the background: "loading"."""
        out: dict[str, int] = {}
        loads = [f.result().cache if f.done() and not f.cancelled() and f.exception() is None else "loading"
                 for f in self._loading.values()]
        for how in [*(exe.cache for exe in self.executables.values()), *self._deferred.values(), *loads]:
            out[how] = out.get(how, 0) + 1
        return out

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.manifest.weights)

    @property
    def pool_bytes(self) -> int:
        return sum(p.nbytes for p in self.manifest.pools)

    @property
    def bytes_per_device(self) -> int:
        """The weights' and pools' bytes one device holds (all of them on one device)."""
        return sum(sharded.bytes_per_device(self.manifest))

    # -- inputs --------------------------------------------------------------------------------------

    def _input_buffer(self, e: af.Entry, key: str, value: np.ndarray) -> sharded.Placed:
        """The device buffer of an input's host value: the one kept from the entry's previous call (never donated, so
        it outlives the call), as it is when the value is the same, else with the new value written over it where
        the device allows (host memory, one device: Device.overwrite); else a new upload that replaces it."""
        kept_key = (e.name, key)            # key: the input's in `inputs` (a role may appear once per row group)
        data = value.tobytes()            # the entry fixes the role's shape and dtype: the bytes say the value
        kept = self._kept_inputs.get(kept_key)
        if kept is not None:
            if kept[0] == data:
                return kept[1]
            if isinstance(kept[1], Buffer) and self.device.overwrite(kept[1], value):
                self._kept_inputs[kept_key] = (data, kept[1])
                self.stats["inputs_overwritten"] += 1
                return kept[1]
        self.stats["inputs_uploaded"] += 1
        buf = sharded.upload_whole(self.device, value)
        if kept is not None:
            sharded.close(kept[1])
        self._kept_inputs[kept_key] = (data, buf)
        return buf

    def neutral_buffer(self, e: af.Entry, role: af.Role) -> sharded.Placed:
        """A device buffer, kept per (entry, role), holding the role's neutral value in every row (no mask, no bias,
        no history, neutral sampling parameters): what a call passes when no row needs that input."""
        key = (e.name, role)
        if key not in self._neutral:
            sig = e.inputs[e.input_index(role)]
            fill = {af.Role.TOKEN_MASK: -1, af.Role.LOGIT_BIAS_IDS: -1, af.Role.TOKEN_HISTORY: -1}.get(role, 0)
            if role == af.Role.SAMPLING:
                fill = np.array([af.SAMPLING_NEUTRAL[c] for c in self.manifest.sampler.columns], np.float32)
            self._neutral[key] = sharded.upload_whole(
                self.device, np.broadcast_to(fill, sig.shape).astype(af.numpy_dtype(sig.dtype)))
        return self._neutral[key]

    def _arg_plan(self, e: af.Entry) -> list[tuple[_ArgSource, object, af.Role]]:
        """Where each of the entry's arguments comes from, in signature order (made once per entry)."""
        plan = self._arg_plans.get(e.name)
        if plan is None:
            plan = []
            for sig in e.inputs:
                if sig.role in af.LORA_ADAPTERS:
                    plan.append((_ArgSource.ADAPTER, (sig.role, sig.slot), sig.role))
                elif (sig.role in af.STEP_FIELDS or sig.role in af.SAMPLER_INPUTS or sig.role in af.SCORER_INPUTS
                        or sig.role in af.DECODE_STEPS_INPUTS or sig.role in af.COPY_INPUTS
                        or sig.role in af.LORA_INPUTS or sig.role == af.Role.HIDDEN_STATES):
                    key = af.STEP_FIELDS.get(sig.role, sig.role)
                    if sig.slot:            # a mixed entry's prompt chunk: its step inputs under "chunk.<field>"
                        key = f"{sig.slot}.{key}"
                    plan.append((_ArgSource.STEP, key, sig.role))
                elif sig.role == af.Role.POOL_IN:
                    plan.append((_ArgSource.POOL, sig.slot, sig.role))
                else:
                    plan.append((_ArgSource.WEIGHT, sig.slot, sig.role))
            self._arg_plans[e.name] = plan
        return plan

    # -- running -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def driving(self, what: str):
        """Run entries (`what` names the caller) as this Runner's one driver: a second thread that tries while one
        does is refused by name, before it touches the pools the first one donates."""
        if not self._driver.acquire(blocking=False):
            raise RuntimeError(f"{what}: thread {self._driver_name!r} is running this artifact's entries; one thread "
                               "drives an Engine (a server's engine loop owns its Engine: send the server requests)")
        self._driver_name = threading.current_thread().name
        try:
            yield
        finally:
            self._driver.release()

    def run(self, e: af.Entry, inputs: dict, want: set[af.Role], count: bool = True) -> dict[af.Role, np.ndarray]:
        """Run entry `e`; -> the outputs whose roles are in `want`, pulled to the host.

        inputs: the step inputs by StepInputs field name (paging.build_step_inputs) and the sampler's, scorer's
        and decode_steps' inputs by role; each a host array, or a device buffer (`neutral_buffer`). count: False for
        a run that is not a call (a warm-up): it goes in stats["warm_ups"], not the executions."""
        if self._arena is not None and self._arena.done():
            self._take_arena()
        exe = self.executable(e)
        runs = self.stats["executions"]
        check = runs < ADDRESS_CHECK_RUNS or e.name not in self._entries_checked
        args: list[sharded.Placed] = []
        pool_args: dict[int, str] = {}
        for i, (source, key, role) in enumerate(self._arg_plan(e)):
            if source is _ArgSource.STEP:
                if key not in inputs:
                    raise KeyError(f"entry {e.name} takes {role} as {key!r}, which its inputs lack (a packed "
                                   f"prefill's come from tlaloc_jax.serve.core.paging.pack_step_inputs)")
                value = inputs[key]
                buf = self._input_buffer(e, key, value) if isinstance(value, np.ndarray) else value
            elif source is _ArgSource.POOL:
                buf = self.pools[key]
                pool_args[i] = key
            elif source is _ArgSource.ADAPTER:
                buf = self.adapters.buffers[key]
            else:
                buf = self.weights[key]
            args.append(buf)
        before = {name: sharded.address(self.device, self.pools[name]) for name in pool_args.values()} if check else {}
        donated_outs = {o for o, _ in e.donations}
        keep = donated_outs | {i for i, sig in enumerate(e.outputs) if sig.role in want}
        outs = sharded.execute(self.device, exe, args, set(pool_args) if self.donate else set(), keep)
        for out_i, in_i in e.donations:
            name = pool_args[in_i]
            if not self.donate:
                sharded.close(self.pools[name])      # the control path: the updated pool is a new buffer
            self.pools[name] = outs[out_i]
        if count:
            self.stats["executions"] += 1
            by = self.stats["executions_by_entry"]
            by[e.name] = by.get(e.name, 0) + 1
        else:
            self.stats["warm_ups"] += 1
        if check:
            self._check_in_place(e, before, runs + 1)
        pulled = {}
        for i, sig in enumerate(e.outputs):
            if i in donated_outs or outs[i] is None:
                continue
            if sig.role in want:
                pulled[sig.role] = self.device.to_host(sharded.first(outs[i]))
            sharded.close(outs[i])
        return pulled

    def _check_in_place(self, e: af.Entry, before: dict[str, int | tuple[int, ...]], run: int) -> None:
        self._entries_checked.add(e.name)
        moved = {n: (a, sharded.address(self.device, self.pools[n])) for n, a in before.items()}
        moved = {n: ab for n, ab in moved.items() if ab[0] != ab[1]}
        self.stats["pool_address_checks"] += 1
        self.stats["pool_in_place"] += int(not moved)
        if moved:
            log.warning("run %d (%s): pools moved (copied, not donated): %s", run, e.name,
                        ", ".join(f"{n} {a} -> {b}" for n, (a, b) in moved.items()))
        else:
            log.debug("run %d (%s): pools updated in place", run, e.name)

    def close(self) -> None:
        self._stop_loading()
        self.device.close()
