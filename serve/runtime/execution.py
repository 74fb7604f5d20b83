"""Running an executable on a Device: its arguments checked, the PJRT call made and awaited, donation verified.

Donation is what keeps the KV pools on the device: an input listed in `donate` must be consumed by the run (its
memory taken by the aliased output); one that is not raises DonationError with the run's outputs, so a silent
copy cannot pass for an update in place.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pypjrt import errors as pjrt_errors

from . import pypjrt_compat as compat
from .handles import Buffer, Executable
from .pypjrt_compat import PjrtBuffer


class DonationError(RuntimeError):
    """An input listed for donation was not consumed by the execution (it was copied instead).

    The execution did run: `outputs` holds its results, and the listed inputs still hold their
    old contents, so the caller loses no state.
    """

    def __init__(self, message: str, *, indices: Sequence[int], outputs: list["Buffer"]):
        super().__init__(message)
        self.indices = tuple(indices)
        self.outputs = outputs


def run_rows(dev, executable: Executable, rows: Sequence[Sequence[Buffer]], donate: Iterable[int],
             keep: Iterable[int] | None) -> list[list[Buffer | None]]:
    """pjrt.Device.execute / execute_sharded on `dev`: rows[d] are device d's arguments (one row on one device)."""
    n, devices = len(rows[0]), len(rows)
    donated = frozenset(donate)
    if donated and not (min(donated) >= 0 and max(donated) < n):
        raise ValueError(f"{executable.label}: donate indices {sorted(donated)} out of "
                         f"range for {n} arguments")
    ptr_rows = []
    for d, args in enumerate(rows):
        if len(args) != n:
            raise ValueError(f"{executable.label}: device {d} has {len(args)} arguments, device 0 {n}")
        ptrs = []
        for i, b in enumerate(args):
            h = b._h
            if not compat.is_live(h):
                where = f" on device {d}" if devices > 1 else ""
                raise ValueError(f"{executable.label}: argument {i}{where} is {compat.state_name(h)} "
                                 f"(an earlier execution consumed it, or it was closed)")
            ptrs.append(compat.raw_pointer(h))
        ptr_rows.append(ptrs)
        if donated:
            handles = [id(b._h) for b in args]
            for i in donated:
                if handles.count(handles[i]) > 1:
                    raise ValueError(f"{executable.label}: argument {i} is donated and also passed "
                                     f"at another index")

    plugin, hot = dev._plugin, dev._hot
    call = executable._call(plugin, n, donated, devices)
    with call.lock:     # one struct per executable: a second thread waits while this one fills and reads it
        for row, ptrs in zip(call.rows, ptr_rows):
            row[:n] = ptrs
        for d in range(devices):
            call.events[d] = None
        try:
            hot.execute(call.args)      # reentrant: XLA may call FFI handlers synchronously inside Execute
        except pjrt_errors.PjrtError as e:
            error = type(e)(f"{executable.label}: {e.message}", e.code)
            with dev._client.diagnose_allocation():     # an allocation failure gets the allocator's state
                raise error from e
        events, out_ptr_rows = list(call.events), [list(r) for r in call.out_rows]
    # Wait before looking at the inputs: a donated input is still being read until then.
    failure = None
    for event in events:
        if event:
            try:
                hot.await_event(event)
            except pjrt_errors.PjrtError as e:
                failure = failure or e
    if failure is not None:
        for ptr in (p for out_ptrs in out_ptr_rows for p in out_ptrs):   # the failed run's results are released
            hot.destroy_buffer(ptr)
        raise failure
    # Once the run is complete its outputs are defined: to_host need not ask for their ready events.
    meta = executable._out_meta
    first = meta is None
    keep = None if keep is None else frozenset(keep)
    ready = all(events)
    out_rows: list[list[Buffer | None]] = []
    for out_ptrs in out_ptr_rows:
        outputs: list[Buffer | None] = []
        for j, ptr in enumerate(out_ptrs):
            if not first and keep is not None and j not in keep:
                hot.destroy_buffer(ptr)
                outputs.append(None)
                continue
            shape, dtype, dense = (None, None, None) if first else meta[j]
            buf = Buffer(PjrtBuffer(plugin, ptr), shape, dtype, ready=ready, hot=hot)
            buf._dense = dense
            outputs.append(dev._own(buf))
        out_rows.append(outputs)
    if first:
        # An executable's results keep their shapes, dtypes and layouts from call to call: read them once.
        executable._out_meta = meta = [(b.shape, b.dtype, dev._dense(b)) for b in out_rows[0]]
        for outputs in out_rows:
            for j, b in enumerate(outputs):
                b._dense = meta[j][2]
                if keep is not None and j not in keep:
                    b.close()
                    outputs[j] = None

    missing = []
    for d, args in enumerate(rows):
        for i in sorted(donated):
            h = args[i]._h
            if hot.is_deleted(compat.raw_pointer(h)):
                compat.mark_donated(h)
            else:
                missing.append((d, i))
    if missing:
        where = (f"{[i for _, i in missing]}" if devices == 1 else
                 ", ".join(f"{i} on device {d}" for d, i in missing))
        raise DonationError(
            f"{executable.label}: donated argument(s) {where} were not consumed: the body "
            f"has no tf.aliasing_output for them or the plugin copied; outputs were written "
            f"elsewhere", indices=sorted({i for _, i in missing}),
            outputs=out_rows[0] if devices == 1 else out_rows)
    return out_rows

