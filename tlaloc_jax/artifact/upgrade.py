"""tlaloc-serving-v2 and v3 manifests as the v4 model reads them (decoder_manifest.py's changelog says what changed)."""

from __future__ import annotations

from .errors import ManifestError
from .vocabulary import PoolKind, Role

SCHEMA_V2 = "tlaloc-serving-v2"
SCHEMA_V3 = "tlaloc-serving-v3"

_V3_POOL_ROLES = {"KV_POOL_IN": Role.POOL_IN, "WINDOW_KV_POOL_IN": Role.POOL_IN,
                  "KV_POOL_OUT": Role.POOL_OUT, "WINDOW_KV_POOL_OUT": Role.POOL_OUT}


def upgrade_v2_v3(raw: dict) -> dict:
    """A v2 or v3 manifest's JSON as v4's: pools get their kind and capacity, pool roles become POOL_IN /
    POOL_OUT, tokenizer files carry an empty hash. The schema string is kept."""
    raw = dict(raw)
    window = raw.pop("window", None) or {}
    if not isinstance(window, dict):
        raise ManifestError("manifest.window must be an object")
    pools = []
    for i, p in enumerate(raw.get("pools") or []):
        if not isinstance(p, dict):
            raise ManifestError(f"manifest.pools[{i}] must be an object")
        ring = p.get("in_role") == "WINDOW_KV_POOL_IN"
        if ring and not window:
            raise ManifestError(f"schema {raw.get('schema')} pool {p.get('name')!r} is windowed, but the manifest "
                                "has no window")
        pools.append({"name": p.get("name"), "kind": PoolKind.RING_KV if ring else PoolKind.PAGED_KV,
                      "dtype": p.get("dtype"), "shape": p.get("shape"), "capacity": p.get("num_blocks"),
                      "layers": p.get("layers", []), "slot_axis": 2,
                      "window": window.get("window", 0) if ring else 0,
                      "ring_pages": window.get("ring_pages", 0) if ring else 0})
    if raw.get("schema") == SCHEMA_V3 and not any(p["kind"] == PoolKind.RING_KV for p in pools):
        raise ManifestError(f"schema {SCHEMA_V3} needs a windowed pool (window_kv)")
    raw["pools"] = pools
    entries = []
    for e in raw.get("entries") or []:
        if isinstance(e, dict):
            e = dict(e)
            for key in ("inputs", "outputs"):
                e[key] = [dict(s, role=_V3_POOL_ROLES.get(s.get("role"), s.get("role"))) if isinstance(s, dict)
                          else s for s in (e.get(key) or [])]
        entries.append(e)
    raw["entries"] = entries
    raw["tokenizer_files"] = [{"file": f, "sha256": ""} for f in raw.get("tokenizer_files") or []]
    return raw
