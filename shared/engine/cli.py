"""Command-line flags of the engine, generated from EngineConfig so the two never drift apart."""
from __future__ import annotations

import argparse
import dataclasses
import re

from shared.engine.config import ATTENTION_BACKENDS, EngineConfig, attention_backend_error, hicache_config_error

_CHOICES = {
    "dtype": ["auto", "float32", "bfloat16", "float16"],
    "attention_backend": list(ATTENTION_BACKENDS),
    "schedule_policy": ["lpm", "fcfs"],
    "load_format": ["auto", "dummy"],
    "quantization": ["none", "fp8"],
    "kv_cache_dtype": ["auto", "fp8_e4m3", "fp8_e5m2", "fp8"],
    "jump_forward_mode": ["retokenize", "verify"],
    "kv_transfer_staging": ["device", "host"],
    "hicache_write_policy": ["write_back", "write_through", "write_through_selective"],
    "speculative_algorithm": ["NGRAM", "STANDALONE", "EAGLE"],
}


def _device(value: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: use auto, cpu, cuda or cuda:N")
    return value


def _attention_backend(value: str) -> str:
    error = attention_backend_error(value)
    if error:
        raise argparse.ArgumentTypeError(error)
    return value


def tp_size_arg(value: str) -> int:
    """argparse type of a tensor-parallel size (also the launcher's per-pool sizes)."""
    from shared.models.parallel import MAX_TP_SIZE

    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if not 1 <= size <= MAX_TP_SIZE:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_TP_SIZE} (the GPUs of one host), got {size}")
    return size


def _int_at_least(minimum: int):
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {number}")
        return number
    return parse


def _pdl_families(value: str) -> str:
    from kernels._utils import parse_pdl_families
    try:
        return ",".join(sorted(parse_pdl_families(value)))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_TYPES = {"device": _device, "attention_backend": _attention_backend, "tp_size": tp_size_arg,
          "stream_interval": _int_at_least(1), "cuda_graph_max_extend_tokens": _int_at_least(0),
          "max_running_requests": _int_at_least(1), "cuda_graph_max_bs": _int_at_least(1),
          "chunked_prefill_size": _int_at_least(1),
          "triton_attention_num_kv_splits": _int_at_least(1), "pdl_early_trigger": _pdl_families,
          "speculative_algorithm": str.upper, "speculative_num_steps": _int_at_least(1),
          "speculative_num_draft_tokens": _int_at_least(2),
          "speculative_ngram_min_match_window_size": _int_at_least(1),
          "speculative_ngram_max_match_window_size": _int_at_least(1),
          "speculative_disable_batch_size": _int_at_least(0)}

# Flag names where SGLang's launcher names the same setting differently: its name first (what --help and
# child processes use), ours kept as an alias. Boolean fields that default to true also take SGLang's
# `--disable-*` spelling.
_NAMES = {
    "max_context_len": ["--context-length", "--max-context-len"],
    "cuda_graph": ["--no-cuda-graph", "--disable-cuda-graph"],
    "enable_pdl": ["--no-enable-pdl", "--disable-pdl"],
    "enable_overlap": ["--no-enable-overlap", "--disable-overlap-schedule"],
    "one_launch_decode_attention": ["--two-launch-decode-attention", "--no-one-launch-decode-attention"],
    "tp_size": ["--tp-size", "--tp"],
    "dequantize_fp8_blocks": ["--fp8-block-kernels", "--no-dequantize-fp8-blocks"],
}

_HELP = {
    "model_path": "hub id, local Hugging Face directory, or tiny-random (a small random Llama for smoke runs)",
    "load_format": "auto: the checkpoint's safetensors; dummy: random weights of the config's shape",
    "device": "auto (cuda if present, else cpu) | cpu | cuda | cuda:N",
    "quantization": "none: as the checkpoint says (its quantization_config is honoured or refused); fp8: "
                    "also quantize a float checkpoint's linear weights to FP8 at load",
    "dequantize_fp8_blocks": "block-scaled FP8 checkpoints (weight_block_size): keep the weights in FP8 with their "
                             "block scales (half the weight memory; the block GEMM is slower than the model dtype's "
                             "on the H200) instead of dequantizing them at load",
    "dtype": "auto: bfloat16 on GPU, float32 on CPU",
    "kv_cache_dtype": "auto: the model's dtype; fp8_e4m3 / fp8_e5m2 (fp8: e4m3): an FP8 KV cache, twice the tokens "
                      "in the same memory, scaled by the checkpoint's per-layer k/v scales where it has them",
    "attention_backend": "auto picks per device (triton on GPU, torch on CPU); flashinfer: FlashInfer's kernels "
                         "(the optional extra: pip install -e \".[flashinfer]\")",
    "page_size": "tokens per KV page (radix matches are page-aligned)",
    "max_total_tokens": "KV pool size in tokens (default: --mem-fraction-static of free memory after weights)",
    "mem_fraction_static": "fraction of free device memory for the KV pool when --max-total-tokens is unset",
    "max_running_requests": "requests decoded together at most (default: derived, one per 256 KV-pool tokens, "
                            "256 to 4096; 256 without a GPU)",
    "max_context_len": "longest prompt + output (default: the model's max_position_embeddings)",
    "chunked_prefill_size": "new tokens of one request per prefill pass, longer prompts take several (default: "
                            "derived, 8192 on GPUs from 60 GB, else 4096, at most a quarter of the KV pool)",
    "max_prefill_tokens": "new tokens of all requests in one prefill pass",
    "enable_mixed_chunk": "running requests decode inside prefill passes (their token counts against "
                          "--max-prefill-tokens) instead of in a decode pass between them",
    "schedule_policy": "lpm: longest cached prefix first; fcfs: arrival order",
    "lpm_queue_limit": "above this queue length LPM falls back to FCFS (0: LPM at any length)",
    "max_skipped_rounds": "a request passed over this many times goes first (no starvation)",
    "disable_radix_cache": "no prefix reuse (the ablation)",
    "enable_hierarchical_cache": "a host-memory KV tier under the radix tree: KV evicted from the device pool moves "
                                 "to pinned host memory and is loaded back when a prompt reuses it",
    "hicache_ratio": "host tier size as a multiple of the device KV pool's tokens (each tensor-parallel rank's "
                     "host pool holds its own KV heads)",
    "hicache_size": "host tier size in GB per tensor-parallel rank, as SGLang's (overrides --hicache-ratio when > 0)",
    "hicache_write_policy": "write_through: new KV is copied to the host as it is cached; write_back: when it is "
                            "evicted (eviction waits for the copy); write_through_selective: when first reused",
    "hicache_load_timeout": "seconds a load from the host tier may take before the prefix is recomputed instead",
    "init_new_token_ratio": "share of running requests' remaining max_new_tokens reserved at admission",
    "min_new_token_ratio": "lower bound the reservation ratio decays to",
    "new_token_ratio_decay": "per-step decay of the reservation ratio",
    "disable_shared_prefix_attention": "decode groups sharing a cached prefix attend it per request, not "
                                       "once per group (the cascade-attention ablation)",
    "cuda_graph": "run decode without CUDA graphs",
    "cuda_graph_max_bs": "largest decode batch captured in a CUDA graph (default: derived, the running requests up to "
                         "1024 on GPUs from 60 GB, else 256)",
    "cuda_graph_max_extend_tokens": "largest extend pass (tokens, up to 4096) captured in a CUDA graph: any number "
                                    "of requests of at most 64 new tokens each (jump-forward catch-up passes, short "
                                    "turns on cached prefixes), or up to 4 longer ones within 512 tokens (a prompt, "
                                    "a few-shot or document chunk); 0: none",
    "enable_pdl": "launch the Triton kernels without programmatic dependent launch (Hopper and newer)",
    "pdl_early_trigger": "with PDL, kernels of these families (comma-separated: attention, norm, rope, gemv) let "
                         "the next kernel launch before they wait on the previous one",
    "triton_attention_num_kv_splits": "triton backend: most chunks a request's context is cut into for split "
                                      "decode attention",
    "one_launch_decode_attention": "triton backend: split decode attention merges its chunks in a second kernel "
                                   "per layer, not in the last program of each request and KV head",
    "decode_norm_fusion": "one-token passes run every residual RMSNorm as its own kernel, not folded into the "
                          "GEMVs around it",
    "decode_l2_prefetch": "one-token passes prefetch each layer's o_proj weight into L2 while rope and attention "
                          "run (Hopper)",
    "decode_rope_fusion": "one-token decode passes run rope and the KV store in a kernel of their own, not in the "
                          "qkv GEMV's epilogue",
    "enable_overlap": "do not overlap the host's scheduling with the device's step",
    "disable_jump_forward": "decode grammar-forced tokens one by one (the ablation)",
    "jump_forward_mode": "retokenize: forced runs as the tokenizer's tokens (fastest); verify: forced "
                         "tokens checked against the model (output equals token-by-token decoding)",
    "jump_forward_threshold": "retokenize mode: jump over forced text only when a step's forced tokens reach "
                              "this many per running request (a catch-up extend pass costs the whole batch "
                              "about that many decode steps) or a prompt is being admitted anyway; 0: always",
    "speculative_algorithm": "speculative decoding: NGRAM (drafts looked up in the request's own prompt and "
                             "output) or STANDALONE (a small draft model, --speculative-draft-model-path); the "
                             "target verifies the drafts in one pass, so greedy output is its own (EAGLE: not "
                             "implemented, refused)",
    "speculative_draft_model_path": "STANDALONE: the draft model (same tokenizer and vocabulary as the target)",
    "speculative_num_steps": "STANDALONE: draft tokens proposed a round, one draft decode step each (default 3)",
    "speculative_num_draft_tokens": "tokens a request verifies in one pass: its last token and the drafts "
                                    "(default: 8 for NGRAM; STANDALONE needs --speculative-num-steps + 1)",
    "speculative_ngram_min_match_window_size": "NGRAM: shortest suffix of the sequence looked up",
    "speculative_ngram_max_match_window_size": "NGRAM: longest suffix of the sequence looked up (tried first)",
    "speculative_disable_batch_size": "speculation is off while more requests than this are running (large "
                                      "batches are compute-bound: drafts would cost more than they save); above a "
                                      "quarter of it the drafts per request are halved; 0: never off",
    "random_seed": "seed of requests without their own",
    "stream_interval": "streaming requests receive new tokens every this many tokens (first and last at once); "
                       "larger values cut per-token serving overhead, smaller ones give smoother streams",
    "kv_transfer_staging": "PD: device (UCX moves GPU memory) or host (pinned buffers, UCX without CUDA)",
    "kv_transfer_timeout": "PD: seconds a decode worker waits for a request's KV pages",
    "kv_transfer_max_bytes": "PD: bytes of KV buffers (gathered pages, receive buffers) a worker's transfers hold "
                             "at once; more wait in order, a single larger prompt goes alone (default: the KV of "
                             "4 prefill chunks on a PD worker, none on a unified one; 0: no bound). The KV pool "
                             "leaves this much free",
    "tp_size": "tensor-parallel ranks: the worker spawns one process per rank (GPUs cuda:N..N+tp-1 from "
               "--device cuda:N; gloo on CPU); must divide the attention heads",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        names = _NAMES.get(f.name, ["--" + f.name.replace("_", "-")])
        if f.type in ("bool", bool):
            if f.default:
                names = _NAMES.get(f.name, ["--no-" + f.name.replace("_", "-")])
                group.add_argument(*names, dest=f.name, action="store_false", help=_HELP.get(f.name))
                parser.set_defaults(**{f.name: True})
            else:
                group.add_argument(*names, dest=f.name, action="store_true", help=_HELP.get(f.name))
            continue
        typ = _TYPES.get(f.name) or next(
            (t for t in (int, float) if f.type is t or str(f.type).startswith(t.__name__)), str)
        group.add_argument(*names, dest=f.name, type=typ, default=f.default, choices=_CHOICES.get(f.name),
                           help=_HELP.get(f.name))
    # The opt-in spellings from before the one-launch merge and block dequantization became the defaults: accepted,
    # change nothing.
    group.add_argument("--one-launch-decode-attention", dest="one_launch_decode_attention", action="store_true",
                       help=argparse.SUPPRESS)
    group.add_argument("--dequantize-fp8-blocks", dest="dequantize_fp8_blocks", action="store_true",
                       help=argparse.SUPPRESS)


def engine_flag_error(args: argparse.Namespace) -> str | None:
    """Why the engine flags cannot work together, or None (the worker and launcher refuse to start)."""
    return hicache_config_error(args)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def engine_args_to_argv(args: argparse.Namespace) -> list[str]:
    """The flags that differ from the defaults, to pass a config on to a child process."""
    argv: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name)
        if value == f.default:
            continue
        if isinstance(value, bool):
            # A bool that differs from its default is exactly its flag.
            argv.append(_NAMES.get(f.name, [("--no-" if f.default else "--") + f.name.replace("_", "-")])[0])
        else:
            argv += [_NAMES.get(f.name, ["--" + f.name.replace("_", "-")])[0], str(value)]
    return argv
