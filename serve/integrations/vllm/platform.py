"""vLLM's platform for tlaloc artifacts: checks vLLM's configuration against the artifact at start-up and points
vLLM at the plugin's worker.

What the artifact fixes is checked here and refused by name before anything is loaded: the block size (vLLM's block
ids are the artifact's page ids), the longest sequence (`--max-model-len` must be a context of the artifact's
ladder), the dtypes, one device (no tensor, pipeline or data parallelism), and the features an artifact does not
have (speculative decoding, multimodal inputs, prompt embeddings, pooling, vLLM quantization). LoRA
(--enable-lora) is served from the artifact's adapter slots, within their count and rank. vLLM's block
manager keeps the paged KV pool, so an artifact without one (every layer windowed) is refused; a ring or state pool
beside it is the worker's (side_pools.py), which turns vLLM's prefix caching off and caps max_num_seqs at what
those pools hold.
"""

from __future__ import annotations

import logging

import torch
from vllm.exceptions import VLLMValidationError
from vllm.platforms.cpu import CpuPlatform

from tlaloc_jax import artifact as af

from .config import CONFIG_FORMAT, TORCH_DTYPES, TlalocArtifactConfig
from .side_pools import max_sequences

log = logging.getLogger("tlaloc_jax.serve.vllm")

WORKER = "tlaloc_jax.serve.integrations.vllm.worker.ArtifactWorker"
# vLLM's --kv-cache-dtype names that mean an artifact's pool dtype ("auto": the artifact's own).
KV_DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


class ArtifactRefused(ValueError):
    """vLLM's configuration asks for something the artifact does not have; the message names it."""


class TlalocPlatform(CpuPlatform):
    """vLLM's CPU platform as far as torch is concerned (the tensors the worker hands vLLM, logits for its sampler
    and logprobs, live on the host), with the artifact's checks and worker in place of vLLM's CPU model runner."""

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        # float32 first: vLLM's "auto" dtype then keeps the config's, which is the artifact's weight dtype.
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        raise ArtifactRefused("a tlaloc artifact's attention is in its entries: vLLM's attention backends are unused")

    # The artifact's refused tokens (a multimodal checkpoint's placeholders), read where vLLM's config is checked:
    # the process that takes requests checks it too.
    refused_tokens: dict[int, str] = {}

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        """Per request: what the artifact refuses or the worker cannot give is refused by name (vLLM answers 400)."""
        ids = processed_inputs.get("prompt_token_ids") if isinstance(processed_inputs, dict) else None
        for t in ids or ():
            if t in cls.refused_tokens:
                raise VLLMValidationError(f"refused token {t} (multimodal placeholder, config key "
                                          f"{cls.refused_tokens[t]}): this artifact is the text decoder only",
                                          parameter="prompt")
        if getattr(params, "prompt_logprobs", None) is not None:
            raise VLLMValidationError("prompt_logprobs: the tlaloc plugin's entries return the logits of each row's "
                                      "last token only (python -m tlaloc_jax.serve scores prompts with the "
                                      "artifact's scoring entries)", parameter="prompt_logprobs")

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        """The CLI's model path is an artifact: its config comes from the manifest unless --config-format says
        otherwise (which the config check then refuses)."""
        if parser is not None:
            parser.set_defaults(config_format=CONFIG_FORMAT)

    @classmethod
    def update_block_size_for_backend(cls, vllm_config) -> None:
        pass            # no attention backend: the block size is the artifact's (check_and_update_config)

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        model_config = vllm_config.model_config
        if model_config is None:
            return
        m = check_artifact_config(vllm_config)
        cls.refused_tokens = {r.token_id: r.config_key for r in m.refused_tokens}
        cache = vllm_config.cache_config
        cache.block_size = m.block_size
        # vLLM's block manager allocates exactly the pages of the artifact's paged pool.
        cache.num_gpu_blocks_override = m.capacity(af.PoolKind.PAGED_KV)
        fit = max_sequences(m)
        if fit is not None:                  # ring and state pools: the worker's own (side_pools.py)
            side = ", ".join(f"{p.name} ({p.kind})" for p in m.pools if p.kind != af.PoolKind.PAGED_KV)
            if cache.enable_prefix_caching:
                log.warning("prefix caching off: a cached prefix would skip the positions that fill %s", side)
                cache.enable_prefix_caching = False
            scheduler = vllm_config.scheduler_config
            if scheduler.max_num_seqs > fit:
                log.warning("max_num_seqs %d -> %d: %s hold %d sequences", scheduler.max_num_seqs, fit, side, fit)
                scheduler.max_num_seqs = fit
        parallel = vllm_config.parallel_config
        parallel.worker_cls = WORKER
        parallel.distributed_executor_backend = "uni"
        vllm_config.scheduler_config.async_scheduling = False
        from vllm.config import CompilationMode, CUDAGraphMode
        vllm_config.compilation_config.mode = CompilationMode.NONE
        vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        vllm_config.compilation_config.cudagraph_capture_sizes = []
        if not any(t.file == "tokenizer.json" for t in m.tokenizer_files):
            model_config.skip_tokenizer_init = True      # an ids-only artifact: prompts are token ids


def check_artifact_config(vllm_config) -> af.Manifest:
    """The artifact's manifest, or ArtifactRefused naming the first setting of vLLM's config it cannot serve."""
    model_config, cache = vllm_config.model_config, vllm_config.cache_config
    hf = model_config.hf_config
    if not isinstance(hf, TlalocArtifactConfig):
        raise ArtifactRefused(f"the tlaloc platform (VLLM_PLUGINS=tlaloc) serves tlaloc artifacts: "
                              f"{model_config.model!r} was read as {type(hf).__name__}; pass an artifact directory "
                              f"with --config-format {CONFIG_FORMAT}")
    m = af.load_manifest(hf.artifact_dir, verify_files=False)
    if not m.pools_of(af.PoolKind.PAGED_KV):
        others = ", ".join(f"{p.name} ({p.kind})" for p in m.pools)
        raise ArtifactRefused(f"artifact {hf.artifact_dir} has no paged KV pool for vLLM's block manager (its pools: "
                              f"{others}); serve it with python -m tlaloc_jax.serve")
    if cache.user_specified_block_size and cache.block_size != m.block_size:
        raise ArtifactRefused(f"--block-size {cache.block_size}: the artifact's pages hold {m.block_size} "
                              f"positions, and vLLM's blocks are its pages (use --block-size {m.block_size})")
    ladder = tuple(m.buckets.context_ladder)
    if model_config.max_model_len not in ladder:
        raise ArtifactRefused(f"--max-model-len {model_config.max_model_len} is not on the artifact's context "
                              f"ladder {list(ladder)}")
    want = TORCH_DTYPES[m.model.weight_dtype]
    if model_config.dtype != want:
        raise ArtifactRefused(f"--dtype {str(model_config.dtype).removeprefix('torch.')}: the artifact's weights "
                              f"are {m.model.weight_dtype}")
    pool_dtype = m.pools_of(af.PoolKind.PAGED_KV)[0].dtype
    if cache.cache_dtype != "auto" and KV_DTYPE_NAMES.get(cache.cache_dtype) != pool_dtype:
        raise ArtifactRefused(f"--kv-cache-dtype {cache.cache_dtype}: the artifact's KV pool is {pool_dtype}")
    override = cache.num_gpu_blocks_override
    if override is not None and override != m.capacity(af.PoolKind.PAGED_KV):
        raise ArtifactRefused(f"--num-gpu-blocks-override {override}: the artifact's KV pool holds "
                              f"{m.capacity(af.PoolKind.PAGED_KV)} pages")
    parallel = vllm_config.parallel_config
    for name, size in (("--tensor-parallel-size", parallel.tensor_parallel_size),
                       ("--pipeline-parallel-size", parallel.pipeline_parallel_size),
                       ("--data-parallel-size", parallel.data_parallel_size)):
        if size != 1:
            raise ArtifactRefused(f"{name} {size}: an artifact runs on one device")
    lora_refusal(vllm_config.lora_config, m, hf.artifact_dir)
    features = [("speculative decoding (--speculative-config)", vllm_config.speculative_config is not None),
                ("multimodal inputs", model_config.is_multimodal_model),
                ("prompt embeddings (--enable-prompt-embeds)", model_config.enable_prompt_embeds),
                (f"the {model_config.runner_type!r} runner", model_config.runner_type != "generate"),
                (f"--quantization {model_config.quantization}", model_config.quantization is not None)]
    for what, asked in features:
        if asked:
            raise ArtifactRefused(f"{what}: a tlaloc artifact has no such feature (its entries are what it runs)")
    return m


def lora_refusal(lora, m: af.Manifest, artifact_dir) -> None:
    """--enable-lora needs an artifact staged with adapter slots (export --max-loras N --max-lora-rank R) and
    --max-loras and --max-lora-rank within them; else ArtifactRefused naming the flag."""
    if lora is None:
        return
    if m.lora is None:
        raise ArtifactRefused(f"LoRA adapters (--enable-lora): artifact {artifact_dir} has no adapter slots; export "
                              "it with --max-loras N --max-lora-rank R")
    for flag, asked, held, what in (("--max-loras", lora.max_loras, m.lora.max_loras, "adapter slots"),
                                    ("--max-lora-rank", lora.max_lora_rank, m.lora.max_rank, "the rank of its slots")):
        if asked > held:
            raise ArtifactRefused(f"{flag} {asked}: the artifact holds {held} ({what}); pass {flag} {held} or "
                                  f"less, or export it with --max-loras and --max-lora-rank that large")
