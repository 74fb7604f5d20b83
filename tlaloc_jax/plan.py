"""The layer plan: which stacked weights and which pool each layer of the decoder reads and writes.

The decoder runs its layers in a lax.scan over layer periods (the shortest run of layer types, with each layer's
MLP kind, that repeats):
scan step i runs the period's layers in order, and each reads its stacked weights and pools at the dynamic
index i * per_period + rank. The plan fixes, once per config, the rank and per-period count of every layer
of a period in each stack it uses; the scan, the pool shapes and the checkpoint's stacking order all read
it, so "which stack holds layer i, at which index" has one definition. JAX-free: the family tables read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import DENSE, LINEAR, SLIDING, SPARSE, DecoderConfig

# The linear-attention layers' pool classes (f32 whatever the KV pools' dtype).
STATE_POOLS = ("conv", "recurrent")
# The "layers" slots of each MLP kind (decoder.feed_forward's names): each stacks only the layers whose MLP is of
# its kind; the group's other slots (the norms) stack every layer.
MLP_SLOTS = {
    DENSE: ("gate_proj", "up_proj", "down_proj", "gate_up_proj"),
    SPARSE: ("router", "router_bias", "router_correction", "expert_gate", "expert_up", "expert_down",
             "expert_gate_bias", "expert_up_bias", "expert_down_bias", "shared_gate", "shared_up", "shared_down",
             "shared_gate_up", "shared_expert_gate"),
}


def mlp_kind_of(slot: str) -> str | None:
    """The MLP kind whose layers a "layers.<name>" slot stacks (None: every layer's, or another group's)."""
    group, _, name = slot.partition(".")
    if group != "layers":
        return None
    return next((kind for kind, names in MLP_SLOTS.items() if name in names), None)


def pool_of(cfg: DecoderConfig, layer_type: str, windowed: bool) -> str:
    """The pool class an attention layer's keys and values live in."""
    return "window_kv" if windowed and layer_type == SLIDING else "kv"


def layer_period(types: tuple) -> int:
    """The shortest p dividing the layer count with types[i] == types[i % p]: one scan step runs p layers."""
    L = len(types)
    for p in range(1, L + 1):
        if L % p == 0 and all(types[i] == types[i % p] for i in range(L)):
            return p
    return L


@dataclass(frozen=True)
class Stacked:
    """A layer's place in stacked buffers [L', ...] that hold per_period layers of each period, in layer
    order: the layer is the rank-th of its period's layers in them."""

    rank: int
    per_period: int

    def index(self, step):
        """The layer's index in the buffers at scan step `step` (an int, or the scan's traced counter)."""
        return step * self.per_period + self.rank


@dataclass(frozen=True)
class LayerPlan:
    """One layer of a period.

    layer: its place in the "layers" weight group's norms, which stack every layer.
    group, weights: the weight group of its attention ("attn" for full and sliding layers, "linear") and
    its place in it. pools, pool: the pools it writes (("kv",), ("window_kv",), or STATE_POOLS, which a
    linear layer indexes alike) and its place in them. mlp, mlp_weights: its MLP's kind (DENSE or SPARSE) and
    its place in the "layers" slots of that kind (MLP_SLOTS), which stack the layers of the kind.
    """

    kind: str          # FULL, SLIDING or LINEAR
    window: int        # the attention's window; 0: full history (and every linear layer)
    layer: Stacked
    group: str
    weights: Stacked
    pools: tuple[str, ...]
    pool: Stacked
    mlp: str = DENSE
    mlp_weights: Stacked | None = None


@dataclass(frozen=True)
class Plan:
    """The decoder's layers: `periods` scan steps, each running the layers of one period in order."""

    periods: int
    layers: tuple[LayerPlan, ...]

    def group_layers(self, group: str) -> tuple[int, ...]:
        """The model's layers that a weight group ("layers", "attn", "linear") stacks, in stack order."""
        return self._holding(lambda lp: group in ("layers", lp.group))

    def slot_layers(self, slot: str) -> tuple[int, ...]:
        """The model's layers that a stacked slot ("group.name") holds, in stack order: its group's, or for an
        MLP slot of the "layers" group (MLP_SLOTS) the layers whose MLP is of its kind."""
        kind = mlp_kind_of(slot)
        if kind is None:
            return self.group_layers(slot.split(".", 1)[0])
        return self._holding(lambda lp: lp.mlp == kind)

    def pool_layers(self, pool: str) -> tuple[int, ...]:
        """The model's layers that a pool stacks, in stack order."""
        return self._holding(lambda lp: pool in lp.pools)

    def pool_names(self) -> tuple[str, ...]:
        """Every pool the layers write, in the order of the first layer that writes each."""
        return tuple(dict.fromkeys(name for lp in self.layers for name in lp.pools))

    def _holding(self, holds) -> tuple[int, ...]:
        # Ranks grow with the layer's place in its period, so layer order is stack order.
        p = len(self.layers)
        return tuple(i * p + j for i in range(self.periods) for j, lp in enumerate(self.layers) if holds(lp))


def layer_plan(cfg: DecoderConfig, windowed: bool) -> Plan:
    """The plan of cfg's layers. windowed: the sliding layers keep their keys and values in rings
    ("window_kv") rather than with the full-history layers ("kv")."""
    p = layer_period(tuple(zip(cfg.layer_types, cfg.mlp_types)))
    types, mlps = cfg.layer_types[:p], cfg.mlp_types[:p]
    groups = tuple("linear" if t == LINEAR else "attn" for t in types)
    pools = tuple(STATE_POOLS if t == LINEAR else (pool_of(cfg, t, windowed),) for t in types)

    def place(members: tuple, j: int) -> Stacked:
        return Stacked(rank=members[:j].count(members[j]), per_period=members.count(members[j]))

    return Plan(periods=cfg.num_layers // p, layers=tuple(
        LayerPlan(kind=t, window=cfg.layer_window(j), layer=Stacked(rank=j, per_period=p), group=groups[j],
                  weights=place(groups, j), pools=pools[j], pool=place(pools, j), mlp=mlps[j],
                  mlp_weights=place(mlps, j))
        for j, t in enumerate(types)))
