"""Engine configuration: one dataclass, filled from the worker's command line."""
from __future__ import annotations

from dataclasses import dataclass

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
# The optional flashinfer extra (pyproject.toml); for the GPU machines, bench/fetch_flashinfer.sh's repacked wheel.
FLASHINFER_INSTALL = 'pip install -e ".[flashinfer]" (flashinfer-python==0.7.4)'


def flashinfer_missing(why: str) -> str:
    """The start-up error of --attention-backend flashinfer without its package."""
    others = ", ".join(b for b in ATTENTION_BACKENDS if b != "flashinfer")
    return (f"attention backend 'flashinfer' needs the flashinfer-python package ({why}): {FLASHINFER_INSTALL}; "
            f"or choose one of {others}")


def attention_backend_error(name: str) -> str | None:
    """Why --attention-backend NAME cannot start, or None: an unknown name, or flashinfer not installed (found
    without importing it)."""
    if name not in ATTENTION_BACKENDS:
        return f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
    if name == "flashinfer":
        import importlib.util

        if importlib.util.find_spec("flashinfer") is None:
            return flashinfer_missing("it is not installed")
    return None


def hicache_config_error(config) -> str | None:
    """Why the host tier flags cannot work together with the others, or None (`config`: an EngineConfig or the
    parsed arguments)."""
    if not config.enable_hierarchical_cache:
        return None
    if config.disable_radix_cache:
        return "--enable-hierarchical-cache needs the radix cache: drop --disable-radix-cache"
    if config.hicache_size < 0 or (config.hicache_size == 0 and config.hicache_ratio <= 0):
        return "the host KV tier needs --hicache-size > 0 (GB) or --hicache-ratio > 0"
    if config.hicache_load_timeout <= 0:
        return "--hicache-load-timeout must be > 0 seconds"
    return None


@dataclass
class EngineConfig:
    model_path: str = "tiny-random"
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights of the config's shape)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # none: as the checkpoint says (its quantization_config is honoured or refused at load); fp8: also
    # quantize a float checkpoint's linear weights to FP8 (per channel) at load.
    quantization: str = "none"
    # Block-scaled FP8 checkpoints (weight_block_size, compressed-tensors block): dequantized at load and run in the
    # model dtype (the default: the block FP8 GEMM was never faster than bf16 at a batch above one row, and slower
    # at thousands of rows: docs/kernels.md), or, with False (--fp8-block-kernels), kept as FP8
    # weights through the block GEMV and GEMM where the blocks tile: half the weight memory.
    dequantize_fp8_blocks: bool = True
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16
    # KV cache element type: auto (the model's dtype) | fp8_e4m3 | fp8_e5m2 (| fp8, vLLM's name for e4m3). FP8 halves
    # the pool's bytes a token (twice the tokens) and decode attention's reads; its values are rounded, with the
    # checkpoint's per-layer k/v scales where it has them (shared/cache/kv_pool.py).
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"  # auto | torch | triton | flashinfer (ATTENTION_BACKENDS)
    page_size: int = 1
    # KV pool size: explicit token count, else a fraction of free device memory after weights.
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    # The next three: None derives them from the KV pool's tokens and the GPU's memory (shared/engine/sizing.py);
    # without a GPU 256 / 256 / 4096.
    max_running_requests: int | None = None
    max_context_len: int | None = None  # default: the model's max_position_embeddings
    chunked_prefill_size: int | None = None  # max new tokens of one request per prefill pass
    max_prefill_tokens: int = 8192  # max new tokens of all requests in one prefill pass
    # Running requests ride along in prefill passes with their one decode token (SGLang's
    # --enable-mixed-chunk): no decode pass between prefill passes, each running request still gains a token
    # a pass. Their tokens count against max_prefill_tokens. Off by default, as in SGLang, until measured.
    enable_mixed_chunk: bool = False
    schedule_policy: str = "lpm"  # lpm (longest prefix match) | fcfs
    # Above this queue length LPM falls back to FCFS (SGLang's threshold too); 0: never. Match lengths are
    # kept incrementally, so ordering a long queue is cheap; what decides is the order itself. With a thousand
    # queued requests in groups sharing long prompts, LPM over the whole queue was no faster than FCFS
    # (docs/kernels.md): it admits cached siblings first, so the decode steps interleaved with the remaining prefills are large, while the
    # makespan is set by the last admission either way.
    lpm_queue_limit: int = 128
    max_skipped_rounds: int = 32  # aging bound: a request passed over this often goes first
    disable_radix_cache: bool = False
    # A host-memory KV tier under the radix tree (SGLang's HiCache flags; shared/cache/hiradix_cache.py): KV evicted
    # from the device pool moves to a host pool of hicache_ratio × its tokens (hicache_size GB instead when > 0) and
    # comes back when a match reaches it. Both sizes are per tensor-parallel rank, as SGLang's: each rank holds a
    # host pool of its own KV heads, of hicache_size GB (so tp_size × that in all). write_through: new KV is copied to the host as it enters the tree;
    # write_back: at eviction; write_through_selective: when a match first reuses it. A load-back not done within
    # hicache_load_timeout seconds is given up (the prefix is recomputed).
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0
    hicache_write_policy: str = "write_through"
    hicache_load_timeout: float = 5.0
    init_new_token_ratio: float = 0.7  # share of remaining max_new_tokens reserved for running requests
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.002
    # Decode batches holding groups of requests with one cached prefix attend it once per group
    # (cascade attention) when the backend judges it pays, in CUDA graphs of their own where the backend
    # can capture it.
    disable_shared_prefix_attention: bool = False
    cuda_graph: bool = True
    cuda_graph_max_bs: int | None = None  # the largest decode batch captured (at most max_running_requests)
    # Extend passes of up to this many tokens (4096 at most; 64 new tokens per request) replay a CUDA graph too:
    # jump-forward's catch-up passes and short turns on cached prefixes, launch-bound when eager
    # (shared/engine/extend_graph.py). 0: extend passes always run eagerly.
    cuda_graph_max_extend_tokens: int = 2048
    # Programmatic dependent launch for our Triton kernels on Hopper and newer: a kernel may be scheduled
    # while the previous one drains (it waits for that one's writes first), and a GEMV starts streaming
    # its weights early. Process-wide (kernels._utils.set_pdl), set before the CUDA graphs are captured.
    enable_pdl: bool = True
    # With PDL, the kernels of these families (comma-separated: attention, norm, rope, gemv) let the next
    # kernel launch before they wait on the previous one, not after: after the two decode-attention stages
    # the o_proj GEMV then streams its first weights under both (kernels._utils.pdl_launch). Off: no family
    # made the batch-1 step shorter, all of them made it longer (docs/kernels.md).
    pdl_early_trigger: str = ""
    # Split decode attention (small batches, the context cut into chunks) merges the chunks in the same
    # launch, in the last program to finish each request and KV head, instead of a second kernel per layer
    # (kernels/attention/triton_decode.py): at most 32 chunks, one launch was faster at every context measured
    # (docs/kernels.md).
    one_launch_decode_attention: bool = True
    # Triton backend: chunks a request's context is cut into at most, in decode batches small enough to
    # split (SGLang's flag name). Fewer chunks mean fewer idle programs at short contexts, longer chunks at
    # long ones (32 was faster than 64 at batch 1: docs/kernels.md).
    triton_attention_num_kv_splits: int = 32
    # One-token passes (decode at batch 1) fold each residual add + RMSNorm after the first into the GEMVs
    # around it: the producer (o_proj, down_proj) adds into the residual and sums its squares, the consumer
    # (qkv_proj, gate_up_proj) applies the norm's scale to its outputs (kernels/residual_norm.py). 63 fewer
    # launches a step on an 8B Llama. Not under tensor parallelism or with a biased producer.
    decode_norm_fusion: bool = True
    # One-token passes ask each layer's o_proj weight into L2 (Hopper's bulk prefetch, kernels/prefetch.py)
    # while rope and decode attention leave the memory system idle (~9 us a layer at batch 1), so that o_proj
    # reads it from L2. Off until measured.
    decode_l2_prefetch: bool = False
    # One-token decode passes rotate q and k and write k, v to the pool in the qkv GEMV's epilogue
    # (kernels/rope_store.py) instead of a rope + KV-store kernel a layer. Not with q/k norms, a qkv bias, partial
    # rotary, tensor parallelism or FP8 qkv weights (where the epilogue's registers cost the GEMV more than the
    # kernel it saves). On by measurement (docs/kernels.md).
    decode_rope_fusion: bool = True
    enable_overlap: bool = True
    disable_jump_forward: bool = False
    # retokenize: forced runs go in as the tokenizer's own tokens (fastest; the model may have chosen
    # another segmentation, so later text can differ). verify: forced tokens are proposals checked in
    # the same pass against what the model samples, so output equals token-by-token decoding exactly.
    jump_forward_mode: str = "retokenize"
    # Retokenize mode: a step's jumps are taken only when their forced tokens reach this many per running
    # request, or the next pass extends anyway. A jump makes the next pass a catch-up extend of the whole
    # batch (a CUDA graph of its own when it fits) instead of a decode step, which costs a few decode steps, and one
    # request's short forced run saves only its own steps (docs/kernels.md). 0: always jump.
    jump_forward_threshold: float = 3.0
    # Speculative decoding (SGLang's flag names; shared/engine/spec/): NGRAM proposes the tokens that followed the
    # latest earlier occurrence of the sequence's last n tokens in the request's own prompt and output (prompt
    # lookup), STANDALONE runs a small draft model of the same tokenizer; the target checks every draft in one
    # extend pass and keeps the prefix it would have produced itself, plus its own next token. None: off.
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    # STANDALONE: draft decode steps a round (the draft tokens proposed); default 3.
    speculative_num_steps: int | None = None
    # Tokens of each request in one verification pass: its last token and the drafts (so drafts = this - 1).
    # Default: 8 for NGRAM, num_steps + 1 for STANDALONE (which needs exactly that).
    speculative_num_draft_tokens: int | None = None
    # NGRAM: suffix lengths tried for a match, longest first.
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # Speculation pays while the step is bound by reading the weights: above this many running requests it
    # is off (those steps decode and overlap as without it); above a quarter of it the drafts per request
    # are halved. 0: speculate at any batch size.
    speculative_disable_batch_size: int = 64
    random_seed: int = 0
    # Streaming requests get their new tokens every this many tokens (the first and the last at once), as
    # SGLang's --stream-interval: fewer, larger increments cut the per-token work of the worker's IO, the
    # wire and the gateway (one SSE event per increment) at the cost of a burstier stream.
    stream_interval: int = 1
    # Tensor parallelism: ranks (one process and one GPU each, NCCL; gloo on CPU) the model is split over.
    tp_size: int = 1
    # PD mode. Staging of KV pages: device (UCX reads/writes GPU memory: cuda_copy / cuda_ipc) or host
    # (pinned host buffers, for UCX builds without CUDA support). A decode-side request whose pages do not
    # arrive within the timeout ends with an error and frees its slots.
    kv_transfer_staging: str = "device"
    kv_transfer_timeout: float = 120.0
    # Bytes of KV buffers outside the pool that each PD side's transfers may hold at once (gathered pages on the
    # prefill side, receive buffers on the decode side; shared/pd/stages.py's TransferBudget): a transfer
    # beyond it waits for room, a single larger one goes alone. None: sizing.transfer_budget_bytes (prefill
    # chunks' worth; a unified worker sets 0, services/worker); 0: no bound. The pool is sized to leave this much free.
    kv_transfer_max_bytes: int | None = None
