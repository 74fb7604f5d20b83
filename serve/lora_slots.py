"""LoRA adapters at run time: PEFT adapters read into host arrays, and the artifact's adapter slots handed out.

An artifact staged with adapter slots (manifest `lora`, tlaloc_jax/lora.py) takes each row's slot; `LoraSlots`
keeps which adapter each slot holds, writes an adapter into a free slot when a request that names it is admitted
(Runner.adapters), and keeps adapters read from disk in a host LRU beyond the slots. A request whose adapter finds
no free slot waits; a slot is reused once no running request holds it. numpy only.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tlaloc_jax import artifact as af

# PEFT's tensor names: base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight ([r, in]; lora_B [out, r]);
# mlp and linear_attn (Gated DeltaNet) modules alike, and a multimodal checkpoint's model.language_model.layers.
_TENSOR = re.compile(r"^base_model\.model\.(?:model\.)?(?:language_model\.)?layers\.(\d+)\."
                     r"(?:self_attn|mlp|linear_attn)\.(\w+)\.lora_([AB])\.weight$")
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# The host LRU's size when none is given (vLLM's max_cpu_loras defaults to max_loras).
DEFAULT_CPU_LORAS = 0


class LoraError(ValueError):
    """An adapter this artifact cannot serve, or an adapter name it does not know."""


@dataclass(frozen=True, eq=False)
class Adapter:
    """One adapter as read: its name, a key unique to this load (cached pages are shared only under it), its rank,
    its scale, and per target (A [L, I, r], B [L, r, O]) in the slots' dtype (layers it lacks are zeros)."""

    name: str
    key: str
    rank: int
    scale: float
    weights: dict

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


_loads = itertools.count(1)


def read_peft(path: str | Path, shape: af.LoraShape, name: str = "") -> Adapter:
    """A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for the slots `shape` describes.
    Refused by name: DoRA, fan_in_fan_out, trained biases, per-module ranks or alphas, modules_to_save, modules
    the artifact did not stage, a rank past its max_rank, tensors of other shapes or names."""
    from safetensors.numpy import load_file
    path = Path(path)
    what = f"LoRA adapter {name or str(path)!r}"
    try:
        cfg = json.loads((path / CONFIG_NAME).read_text())
        tensors = load_file(path / WEIGHTS_NAME)
    except (OSError, ValueError) as e:
        raise LoraError(f"{what}: cannot read {CONFIG_NAME} and {WEIGHTS_NAME} in {path}: {e}") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"{what} is a {cfg.get('peft_type')} adapter; only LORA adapters are served")
    for key, ok in (("use_dora", not cfg.get("use_dora")), ("fan_in_fan_out", not cfg.get("fan_in_fan_out")),
                    ("bias", cfg.get("bias", "none") == "none"), ("rank_pattern", not cfg.get("rank_pattern")),
                    ("alpha_pattern", not cfg.get("alpha_pattern")),
                    ("modules_to_save", not cfg.get("modules_to_save"))):
        if not ok:
            raise LoraError(f"{what} sets {key} {cfg.get(key)!r}, which the adapter slots do not hold (only plain "
                            "LoRA: use_dora false, fan_in_fan_out false, bias 'none', one rank and alpha, no "
                            "modules_to_save)")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoraError(f"{what}: r {rank!r} and lora_alpha {alpha!r} must be a positive integer and a number")
    if rank > shape.max_rank:
        raise LoraError(f"{what} has rank {rank}, past the artifact's max_lora_rank {shape.max_rank}; export it "
                        f"with --max-lora-rank {rank} or more")
    targets = {t.name: t for t in shape.targets}
    declared = cfg.get("target_modules") or []
    if isinstance(declared, list):
        unstaged = sorted(set(declared) - set(targets))
        if unstaged:
            raise LoraError(f"{what} targets {unstaged}, which the artifact did not stage adapters on (it has "
                            f"{', '.join(targets)}; export with --lora-target-modules)")
    dtype = af.numpy_dtype(shape.dtype)
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _TENSOR.match(key)
        if m is None:
            raise LoraError(f"{what}: tensor {key!r} is not a LoRA A or B of a decoder layer's projection")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        t = targets.get(module)
        if t is None:
            raise LoraError(f"{what} has tensors for {module!r}, which the artifact did not stage adapters on (it "
                            f"has {', '.join(targets)})")
        want = (rank, t.inputs) if half == "A" else (t.outputs, rank)
        if layer not in t.layer_ids or tuple(value.shape) != want:
            raise LoraError(f"{what}: {key} is {list(value.shape)} at layer {layer}; the artifact's {module} takes "
                            f"{list(want)} in layers {_spans(t.layer_ids)}")
        if module not in weights:
            weights[module] = (np.zeros((t.layers, t.inputs, rank), dtype), np.zeros((t.layers, rank, t.outputs), dtype))
        a, b = weights[module]
        (a if half == "A" else b)[t.layer_ids.index(layer)] = value.T.astype(dtype)
    if not weights:
        raise LoraError(f"{what} holds no LoRA tensors")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return Adapter(name or path.name, f"{name or path.name}#{next(_loads)}", rank, float(scale), weights)


def _spans(ids: tuple[int, ...]) -> str:
    """Layer ids as the reader writes them: "0..11", or "3, 7, 11" for some layers only."""
    return f"0..{len(ids) - 1}" if ids == tuple(range(len(ids))) else ", ".join(map(str, ids))


@dataclass(frozen=True)
class LoraModule:
    """A served adapter: the name requests pick it by, its directory, the model it is listed under."""

    name: str
    path: str
    base_model_name: str | None = None


class LoraSlots:
    """The adapters an engine serves and the artifact's slots 1..max_loras. Registration (add, remove) may come from
    any thread; acquire and release run on the engine's thread, between calls, and write slots there."""

    def __init__(self, shape: af.LoraShape, write, max_cpu_loras: int = DEFAULT_CPU_LORAS):
        self.shape = shape
        self._write = write                      # write(slot, Adapter): the device's copy of the slot
        self.modules: dict[str, LoraModule] = {}
        self._host: collections.OrderedDict[str, Adapter] = collections.OrderedDict()   # name -> adapter, LRU
        self.max_cpu_loras = max(max_cpu_loras or shape.max_loras, 1)
        self._holder: list[str | None] = [None] * (shape.max_loras + 1)    # slot -> adapter key (0: none)
        self._users = [0] * (shape.max_loras + 1)
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()     # slots of no user, LRU first
        self._lock = threading.Lock()
        self.stats = dict(slot_writes=0, disk_reads=0)

    def add(self, name: str, path: str | Path, base_model_name: str | None = None) -> Adapter:
        """Serve the adapter at `path` as `name` (read and checked now; a bad one is refused by name). A name served
        already is refused: remove it first."""
        with self._lock:
            if name in self.modules:
                raise LoraError(f"LoRA adapter {name!r} is already loaded; unload it first")
        adapter = read_peft(path, self.shape, name)
        with self._lock:
            self.modules[name] = LoraModule(name, str(path), base_model_name)
            self._remember(adapter)
        return adapter

    def remove(self, name: str) -> None:
        """Stop serving `name`: new requests cannot pick it; requests that did keep it until they end."""
        with self._lock:
            if self.modules.pop(name, None) is None:
                raise LoraError(f"LoRA adapter {name!r} is not loaded")
            self._host.pop(name, None)

    def adapter(self, name: str) -> Adapter:
        """The adapter a request names, from the host LRU or read again from its directory."""
        with self._lock:
            module = self.modules.get(name)
            if module is None:
                raise LoraError(f"LoRA adapter {name!r} is not loaded")
            cached = self._host.get(name)
            if cached is not None:
                self._host.move_to_end(name)
                return cached
        adapter = read_peft(module.path, self.shape, name)
        with self._lock:
            self.stats["disk_reads"] += 1
            if self.modules.get(name) is module:
                self._remember(adapter)
        return adapter

    def _remember(self, adapter: Adapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def acquire(self, adapter: Adapter) -> int | None:
        """A slot holding `adapter` for one more request: the one it is in, else a free one (written now), else
        the least recently used idle one (written over); None when every slot is held (the request waits)."""
        slot = next((i for i, k in enumerate(self._holder) if i and k == adapter.key), None)
        if slot is None:
            free = next((i for i, k in enumerate(self._holder) if i and k is None), None)
            slot = free if free is not None else next(iter(self._idle), None)
            if slot is None:
                return None
            self._write(slot, adapter)
            self.stats["slot_writes"] += 1
            self._holder[slot] = adapter.key
        self._users[slot] += 1
        self._idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        """A request that held `slot` ended or was preempted."""
        if slot <= 0:
            return
        if self._users[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self._users[slot] -= 1
        if not self._users[slot]:
            self._idle[slot] = None

    @property
    def held(self) -> int:
        """Slots some request holds."""
        return sum(1 for u in self._users[1:] if u)

    def resident(self) -> dict[int, str]:
        """slot -> the key of the adapter in it."""
        return {i: k for i, k in enumerate(self._holder) if i and k is not None}
