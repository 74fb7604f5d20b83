"""The artifact contract: what the exporter writes and the JAX-free runtime reads (standard library only).

    vocabulary.py        roles, pool / entry / bound kinds, dtypes, quantization schemes, sampling columns, mask width
    records.py           records both schemas hold (TensorSig, weight and tokenizer files, versions) and their checks
    codec.py             a manifest's JSON <-> its frozen dataclasses
    files.py             paths inside the artifact, sha256, the body files and their @main
    digests.py           the sha256 of files unchanged since a load before, remembered (FileDigests, load_remembering)
    mlirbc.py            MLIR bytecode's container: strings, dialects, attribute and type tables, op properties
    stablehlo.py         a body's @main read from its portable bytecode (.mlirbc)
    mesh.py              a multi-device artifact's mesh, and every partition checked against it
    decoder_manifest.py  the decoder's schema (tlaloc-serving-v5), upgrade.py reading v2 and v3 into it,
                         serving_load.py its cross-checks and load_manifest
    bounded_manifest.py  the bounded program's schema (tlaloc-bounded-v2), its checks and load_bounded

The decoder's names are here at the top (`from tlaloc_jax import artifact as af; af.Role`, `af.load_manifest`);
the bounded program's stay in their module (`from tlaloc_jax.artifact import bounded_manifest`).
"""

from .codec import record_json
from .decoder_manifest import (MANIFEST_NAME, MAX_MANIFEST_BYTES, SCHEMA_V4, SCHEMA_V5, SUPPORTED_SCHEMAS, Buckets,
                               Entry, LoraShape, LoraTarget, Manifest, ModelShape, Pool, RefusedToken, SamplerShape, ScorerShape)
from .digests import FileDigests, load_remembering
from .errors import ManifestError
from .files import checked_file, resolve_inside, sha256_file
from .mesh import Mesh, MeshAxis
from .records import Partition, TensorSig, TokenizerFile, Versions, WeightFile, WeightQuant, WeightShard
from .serving_load import artifact_file, check_manifest, load_manifest
from .stablehlo import MainSignature, main_signature, signature_mismatch
from .upgrade import SCHEMA_V2, SCHEMA_V3
from .vocabulary import (BASE_STEP_INPUTS, CHUNK_GROUP, COPY_INPUTS, DECODE_STEPS_INPUTS, DECODE_STEPS_OUTPUTS, DTYPES, GROUPED_SCHEMES,
                         LORA_ADAPTERS, LORA_INPUTS,
                         INPUT_ROLES, MLIR_DTYPES, NAME, OUTPUT_ROLES, PACKED_TOKEN_INPUTS, PLATFORMS, POOL_KIND_INPUTS, QUANT_CODE_DTYPES, QUANT_GROUPS,
                         QUANT_PART_DTYPES, QUANT_PARTS,
                         SAMPLER_DTYPES, SAMPLER_INPUTS, SAMPLER_OUTPUTS, SAMPLING_COLUMNS, SAMPLING_NEUTRAL,
                         SCORER_DTYPES, SCORER_INPUTS, SCORER_OUTPUTS, STEP_FIELDS, VERIFY_DTYPES, VERIFY_OUTPUTS,
                         BoundKind, DType, EntryKind, PoolKind, QuantPart, QuantScheme, Role, dtype_info, mask_words, nbytes, numpy_dtype)

__all__ = [
    "FileDigests", "load_remembering", "ManifestError", "checked_file", "resolve_inside", "sha256_file", "record_json", "Mesh", "MeshAxis", "Partition",
    "TensorSig", "TokenizerFile", "Versions", "WeightFile", "WeightQuant", "WeightShard",
    "MANIFEST_NAME", "MAX_MANIFEST_BYTES", "SCHEMA_V2", "SCHEMA_V3", "SCHEMA_V4", "SCHEMA_V5", "SUPPORTED_SCHEMAS", "Buckets",
    "Entry", "LoraShape", "LoraTarget", "Manifest", "ModelShape", "Pool", "RefusedToken", "SamplerShape", "ScorerShape",
    "artifact_file", "check_manifest", "load_manifest", "MainSignature", "main_signature", "signature_mismatch",
    "BASE_STEP_INPUTS", "CHUNK_GROUP", "COPY_INPUTS", "DECODE_STEPS_INPUTS", "DECODE_STEPS_OUTPUTS", "DTYPES", "LORA_ADAPTERS", "LORA_INPUTS", "GROUPED_SCHEMES", "INPUT_ROLES", "MLIR_DTYPES",
    "NAME", "OUTPUT_ROLES", "PACKED_TOKEN_INPUTS", "PLATFORMS", "POOL_KIND_INPUTS", "QUANT_CODE_DTYPES", "QUANT_GROUPS",
    "QUANT_PART_DTYPES", "QUANT_PARTS", "SAMPLER_DTYPES",
    "SAMPLER_INPUTS", "SAMPLER_OUTPUTS", "SAMPLING_COLUMNS", "SAMPLING_NEUTRAL", "SCORER_DTYPES", "SCORER_INPUTS",
    "SCORER_OUTPUTS", "STEP_FIELDS", "VERIFY_DTYPES", "VERIFY_OUTPUTS", "BoundKind", "DType", "EntryKind", "PoolKind", "QuantPart", "QuantScheme",
    "Role", "dtype_info", "mask_words", "nbytes", "numpy_dtype",
]
