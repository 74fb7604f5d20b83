"""python -m tlaloc_jax.export CHECKPOINT_DIR OUT_DIR [options]"""

from __future__ import annotations

import argparse
import sys
import time

from tlaloc_jax.artifact import QUANT_GROUPS

from ._options import DEFAULT_BATCH_LADDER, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_LONG_CHUNK, DEFAULT_PREFILL_MAX_BATCH
from . import _timing as timing
from ._quant import HEAD_QUANT, WEIGHT_QUANT


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


DEFAULT_CONTEXTS = (64, 256, 1024)


def default_context_ladder(checkpoint: str, block_size: int) -> list[int]:
    """64, 256, 1024: those within the checkpoint's max_position_embeddings (the largest multiple of the block
    size within it when none is)."""
    from tlaloc_jax.checkpoint import read_config
    from tlaloc_jax.families import config_from_hf
    longest = config_from_hf(read_config(checkpoint))[1].max_position_embeddings
    return [c for c in DEFAULT_CONTEXTS if c <= longest] or [max(block_size, longest // block_size * block_size)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tlaloc_jax.export",
        description="Export a Hugging Face checkpoint (config.json + safetensors) as a serving artifact: "
                    "tlaloc-serving.json, one StableHLO body per (kind, batch, context) entry with the KV pool "
                    "donated, raw weight files and the tokenizer files.")
    ap.add_argument("paths", nargs="+", metavar="CHECKPOINT_DIR OUT_DIR",
                    help="checkpoint directory (config.json, model.safetensors or sharded files) and the artifact "
                         "directory to write (must be empty or absent); with --demo, OUT_DIR alone")
    ap.add_argument("--demo", action="store_true",
                    help="export the embedded model (tlaloc_jax/demo_model, trained by "
                         "python -m tlaloc_jax.tools.train)")
    ap.add_argument("--batch-ladder", type=_ints, default=list(DEFAULT_BATCH_LADDER),
                    help=f"decode batch buckets (default {','.join(map(str, DEFAULT_BATCH_LADDER))})")
    ap.add_argument("--context-ladder", type=_ints, default=None,
                    help="context buckets in positions, multiples of the block size (default 64,256,1024, those "
                         "within the checkpoint's max_position_embeddings: 64,256 for --demo); prefill and mixed "
                         "entries are staged at each, decode entries as --decode-contexts says")
    ap.add_argument("--decode-contexts", choices=["top", "every"], default=None,
                    help="the contexts of the decode (and --decode-steps, verify) entries: top (the ladder's largest "
                         "alone: the native decode attention loops over each row's own keys, so a short row costs "
                         "there what it would at a smaller context, and the server picks the smallest entry that "
                         "holds a call) or every; default top where every attention layer decodes with the native "
                         "kernel (not --decode-attention xla, not sliding-window rings), else every")
    ap.add_argument("--prefill-max-batch", type=int, default=None,
                    help="largest batch of the prefill entries (default: the largest batch bucket, at most "
                         f"{DEFAULT_PREFILL_MAX_BATCH}; 1 = batch-1 only)")
    ap.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                    help=f"tokens per sequence of a prefill call (default {DEFAULT_PREFILL_CHUNK}; 0: the entry's whole "
                         "context); a runtime prefills longer prompts in several calls")
    ap.add_argument("--prefill-long-chunk", type=int, default=DEFAULT_PREFILL_LONG_CHUNK,
                    help=f"tokens of one more one-row prefill entry per context, for a prompt read alone (default "
                         f"{DEFAULT_PREFILL_LONG_CHUNK}; 0: none)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV page (default 16)")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="pages in the KV pool (default: room for the largest batch at the largest context)")
    ap.add_argument("--weight-dtype", choices=["f32", "bf16"], default="f32", help="weight dtype (default f32)")
    ap.add_argument("--kv-dtype", choices=["f32", "bf16", "fp8"], default="f32",
                    help="KV pool dtype (default f32); fp8 stores keys and values as e4m3fn, clamped to +-448, no scale")
    ap.add_argument("--weight-quant", choices=WEIGHT_QUANT, default="none",
                    help="store the projections (q, k, v, o, output gate, gate, up, down, experts) as int8 or fp8 codes "
                         "with a scale per output channel, or int4 codes with a scale (uint4: a scale and a zero point) per "
                         "--quant-group input channels, "
                         "quantized from the checkpoint's values; embedding and norms keep the weight dtype, the head "
                         "--head-quant's "
                         "(default none). It changes the model's numerics: python -m tlaloc_jax.tools.quality "
                         "measures it")
    ap.add_argument("--quant-group", type=int, choices=QUANT_GROUPS, default=128,
                    help="input channels per int4 or uint4 scale (default 128)")
    ap.add_argument("--head-quant", choices=HEAD_QUANT, default=None,
                    help="the output head: int8 codes with a scale per output channel, or none (the weight dtype); "
                         "default int8 with --weight-quant int4 or uint4 (as llama.cpp keeps its head above 4 bits), "
                         "else none")
    ap.add_argument("--attention-block", type=int, default=2048,
                    help="key block of the blockwise attention loop, in positions (default 2048)")
    ap.add_argument("--windowed-kv", choices=["true", "false"], default="true",
                    help="sliding-window layers keep a ring of pages per sequence in their own pool (manifest v3; "
                         "default true); false keeps every layer in the full-history pool (a v2 artifact)")
    ap.add_argument("--window-blocks", type=int, default=None,
                    help="pages in the windowed pool (default: a ring per sequence of the largest context that the "
                         "full pool holds)")
    ap.add_argument("--state-slots", type=int, default=None,
                    help="slots of the linear-attention state pools, one per live sequence and spares for the state "
                         "snapshots of prefix caching (default: as many sequences as the full pool holds at the largest "
                         "context, plus the largest batch)")
    ap.add_argument("--weight-layout", choices=["per-layer", "stacked"], default="per-layer",
                    help="per-layer (default): one array per layer and projection, q|k|v and gate|up fused, the layer "
                         "loop unrolled (XLA's CPU dots read them in place); stacked: one [L, ...] stack per slot, "
                         "scanned (smaller bodies, faster compiles; see tlaloc_jax/layout.py)")
    ap.add_argument("--platform", choices=["cpu", "cuda"], default="cpu",
                    help="platform the bodies are lowered for, one per artifact (default cpu)")
    ap.add_argument("--decode-attention", choices=["native", "pallas", "xla"], default=None,
                    help="decode entries' paged attention: native (a C kernel for the CPU, built and registered by "
                         "the serving runtime, which then needs a C compiler; cpu's default where the model fits it: "
                         "docs/cpu.md), xla (plain ops; cuda's default) or pallas (a Pallas GPU kernel lowered "
                         "through Triton, cuda only; not the default until a GPU run shows it correct and faster: "
                         "docs/gpu.md)")
    ap.add_argument("--projections", choices=["native", "xla"], default=None,
                    help="the projections of calls of a few rows: native (a C kernel for the CPU that widens bf16 and "
                         "int8 weights in registers, built and registered by the serving runtime; cpu's default on "
                         "one device: docs/cpu.md) or xla (XLA's own forms)")
    ap.add_argument("--no-sampler", action="store_true",
                    help="stage the model's step alone, without the sampler in each entry (temperature, top-k, top-p, "
                         "min-p, penalties, logit bias, structured-output masks and logprobs computed in the body); the "
                         "server then samples on the host from pulled logits")
    ap.add_argument("--top-logprobs", type=int, default=20,
                    help="the sampler's top logprobs per token (default 20, OpenAI's largest top_logprobs)")
    ap.add_argument("--logit-bias-slots", type=int, default=64,
                    help="logit_bias entries a request may carry (default 64)")
    ap.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                    help="add a scoring prefill entry beside each prefill entry: echo + logprobs and prompt_logprobs "
                         "(up to N top logprobs per prompt token) then read a prompt in chunks, scored in the body; "
                         "without it such a prompt is read a token a call (default: none)")
    ap.add_argument("--no-packed", action="store_true",
                    help="plain prefill entries of each batch (by default, for models of attention layers only, the "
                         "prefill entries of several rows compute their rows' tokens side by side, not their padding)")
    ap.add_argument("--no-mixed", action="store_true",
                    help="no mixed entries (by default, for models of attention layers only, one entry per context and "
                         "decode batch of 4 or more runs the running sequences' decode tokens and one prompt chunk in "
                         "one call)")
    ap.add_argument("--entries", choices=["default", "flat"], default="default",
                    help="default: decode entries per batch, prefill and packed prefill entries, mixed entries (as the "
                         "options above say); flat: only packed calls, one per context and token-count bucket (powers "
                         "of two), decode rows and prompt chunks side by side in them, each token attending alone, as "
                         "vLLM lays a step's tokens out (models of attention layers only)")
    ap.add_argument("--decode-steps", type=int, default=1, metavar="K",
                    help="K > 1 adds, beside each decode entry, one that runs up to K decode steps in one call (each "
                         "token fed to the next, stopping a row on its stop ids or length); the server uses it while "
                         "every sequence is decoding (default 1: single steps only)")
    ap.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                    help="K > 0 adds, beside each decode entry, a verify entry that scores each sequence's last token "
                         "and up to K drafted tokens in one call (speculative decoding: serve --speculative-config); "
                         "not for models with linear-attention layers (default 0: none)")
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                    help="N > 1 stages every entry for N devices, each holding 1/N of the heads, KV heads, MLP width "
                         "and experts (one all-reduce per attention and per MLP; docs/multi-device.md); the server "
                         "then runs it on N devices (default 1)")
    ap.add_argument("--max-loras", type=int, default=0, metavar="N",
                    help="N > 0 stages N LoRA adapter slots in every entry; the server loads PEFT adapters into them "
                         "without compiling again (default 0: none)")
    ap.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                    help="the largest adapter rank the slots hold (default 16); smaller ranks are zero-padded")
    ap.add_argument("--lora-dtype", choices=["f32", "bf16"], default=None,
                    help="the dtype the adapter slots hold A and B in (default bf16: a step with an adapter row reads "
                         "every slot, and bf16 halves those bytes; docs/lora.md)")
    ap.add_argument("--lora-target-modules", type=lambda t: [m for m in t.split(",") if m], default=None,
                    metavar="q_proj,...", help="the projections that take adapters (default: every one the model has of "
                                               "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj and "
                                               "the linear-attention in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, "
                                               "out_proj)")
    ap.add_argument("--allow-longer-context", action="store_true",
                    help="export a context ladder past the checkpoint's max_position_embeddings (refused otherwise; "
                         "with this flag it is a warning)")
    ap.add_argument("--mlir", action="store_true",
                    help="also write each body's textual StableHLO (bodies/*.mlir), for reading and debugging; the "
                         "server needs only the manifest and the bytecode (bodies/*.mlirbc)")
    ap.add_argument("--exported", action="store_true",
                    help="also write jax's serialization of each body (bodies/*.exported), for jax callers that "
                         "re-trace or run it (jax.export.deserialize); the server does not read it")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help="do not compile the entries into OUT_DIR/compile-cache (by default, for cpu, they are "
                         "compiled here with the serving runtime's plugin, so a server on a host like this one starts "
                         "without compiling; on another CPU or plugin it compiles them, as without the folder)")
    ap.add_argument("--compile-processes", type=int, default=None, metavar="N",
                    help="processes that compile the entries into OUT_DIR/compile-cache, each a share of them (default "
                         "and most: one a core this process may run on)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if args.compile_processes is not None and args.compile_processes < 1:
        ap.error(f"--compile-processes must be at least 1, got {args.compile_processes}")
    if len(args.paths) != (1 if args.demo else 2):
        ap.error("expected OUT_DIR with --demo, else CHECKPOINT_DIR OUT_DIR")
    if args.demo:
        from tlaloc_jax.checkpoint import DEMO_MODEL
        args.checkpoint, args.out = str(DEMO_MODEL), args.paths[0]
    else:
        args.checkpoint, args.out = args.paths

    from . import ExportError, Sampler, export_checkpoint
    from tlaloc_jax.checkpoint import CheckpointError
    from tlaloc_jax.config import ConfigError

    if args.context_ladder is None:
        try:
            args.context_ladder = default_context_ladder(args.checkpoint, args.block_size)
        except (CheckpointError, ConfigError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    dtypes = {"f32": "float32", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}
    timing.reset()
    t0 = time.perf_counter()
    try:
        m = export_checkpoint(args.checkpoint, args.out, batch_ladder=args.batch_ladder,
                              context_ladder=args.context_ladder, prefill_max_batch=args.prefill_max_batch,
                              prefill_chunk=args.prefill_chunk, prefill_long_chunk=args.prefill_long_chunk,
                              block_size=args.block_size,
                              num_blocks=args.num_blocks, weight_dtype_name=dtypes[args.weight_dtype],
                              kv_dtype=dtypes[args.kv_dtype], attention_block=args.attention_block,
                              windowed_kv=args.windowed_kv == "true", window_blocks=args.window_blocks,
                              state_slots=args.state_slots, weight_layout=args.weight_layout,
                              platform=args.platform, progress=not args.quiet,
                              sampler=None if args.no_sampler else Sampler(args.top_logprobs, args.logit_bias_slots),
                              allow_longer_context=args.allow_longer_context,
                              prompt_logprobs=args.prompt_logprobs,
                              decode_attention=args.decode_attention, projections=args.projections,
                              weight_quant=args.weight_quant, quant_group=args.quant_group,
                              head_quant=args.head_quant,
                              decode_steps=args.decode_steps, mixed=False if args.no_mixed else None,
                              packed=False if args.no_packed else None, entries=args.entries,
                              tensor_parallel=args.tensor_parallel, mlir=args.mlir, exported=args.exported,
                              max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                              lora_dtype=dtypes[args.lora_dtype] if args.lora_dtype else None,
                              **({"lora_target_modules": args.lora_target_modules} if args.lora_target_modules else {}),
                              speculative_tokens=args.speculative_tokens, decode_contexts=args.decode_contexts)
    except (ExportError, CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wbytes = sum(w.nbytes for w in m.weights)
    pools = ", ".join(f"{p.name} ({p.kind}) {p.capacity} {'slots' if p.kind == 'state_slots' else 'pages'}"
                      for p in m.pools)
    print(f"wrote {args.out}: {len(m.entries)} entries, {len(m.weights)} weights ({wbytes / 2**20:.1f} MiB), "
          f"pools {pools}, pages of {m.block_size} tokens"
          + (f", rings of {m.ring.ring_pages} pages for window {m.ring.window}" if m.ring else "")
          + (f", sampler in every entry (top {m.sampler.top_logprobs} logprobs)" if m.sampler else ", no sampler")
          + (f", scoring prefill entries (top {m.scorer.top_logprobs} prompt logprobs)" if m.scorer else "")
          + (f", verify entries ({args.speculative_tokens} drafted tokens)" if args.speculative_tokens else "")
          + (f", for {m.devices} devices (tensor parallel)" if m.mesh else "")
          + (f", {m.lora.max_loras} LoRA slots of rank {m.lora.max_rank}" if m.lora else "")
          + f", {m.schema}, in {time.perf_counter() - t0:.1f} s")
    print(f"time: {timing.summary()}")
    if args.platform == "cpu" and not args.no_compile_cache:
        _compile_cache(args.out, args.compile_processes)
    return 0


def _compile_cache(out: str, processes: int | None = None) -> None:
    """Compile the artifact's entries into its compile-cache folder, in a process of its own (the serving runtime's
    PJRT plugin, not jax's). A host without the runtime, or a failed compile, leaves an artifact without one."""
    import subprocess
    print(f"compiling the entries into {out}/compile-cache for the serving runtime (--no-compile-cache skips it)",
          flush=True)
    more = [] if processes is None else ["--processes", str(processes)]
    done = subprocess.run([sys.executable, "-m", "tlaloc_jax.serve.runtime.shipped_cache", out, *more],
                          capture_output=True, text=True)
    if done.returncode == 0:
        print(done.stdout.strip())
    else:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"note: the entries were not compiled into {out}/compile-cache ({tail}); a server compiles them at "
              "its first start", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
