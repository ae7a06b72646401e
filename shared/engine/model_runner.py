"""Owns the model, the KV memory and the attention backend; turns a ScheduleBatch into sampled tokens."""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from shared.cache.kv_pool import KVPool, ReqToTokenPool, kv_cache_dtype
from shared.engine.config import EngineConfig
from shared.models.forward_batch import ForwardBatch, ForwardMode
from shared.engine.prefill_adder import chunk_len, max_riders
from kernels.h2d import to_device
from shared.engine.request import PENDING_TOKEN, Req
from shared.engine.penalties import penalized
from shared.engine.sampler import SamplingBatch, sample
from shared.engine.schedule_batch import ScheduleBatch

log = logging.getLogger(__name__)

_LOGPROB_CHUNK = 1024  # rows of full-vocab logits materialized at once for input logprobs
_CPU_DEFAULT_TOKENS = 65536


def resolve_device(name: str) -> torch.device:
    """auto | cpu | cuda | cuda:N. A CUDA device is made current for the calling thread (Triton and
    events use the current device); the engine thread does the same when it starts."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@dataclass
class StepOutput:
    """Per request of the batch, in order. Entries for non-sampling requests are None."""
    next_token_ids: list[int | None]
    logprobs: list[float | None]
    top_logprobs: list[list[list[float | int]] | None]
    # Input logprobs computed this pass, per request: list of [logprob, token_id] and top lists.
    input_logprobs: list[list | None]
    input_top_logprobs: list[list | None]
    # Requests that carried proposed (jump-forward, verify mode) tokens: the sample at each proposal
    # position and after the last, with their logprobs. next_token_ids holds the last of them.
    proposal_samples: dict = None
    proposal_logprobs: dict = None
    proposal_top_logprobs: dict = None  # requests that asked for top logprobs: one top list per row

    def __post_init__(self):
        self.proposal_samples, self.proposal_logprobs, self.proposal_top_logprobs = {}, {}, {}


class PendingStep:
    """A launched step: device work enqueued, results copied to the host asynchronously. `resolve()`
    waits for them; until then the CPU is free to schedule and launch the next step.

    A step with grammar-constrained requests is launched in two halves: the forward pass first, its
    sampling later (`ModelRunner.sample_pending`), once the engine has advanced the grammars by the
    previous step's tokens; the host fills the masks while the device runs the forward. Rows in
    `dropped` (requests whose next input changed on the host meanwhile: jump-forward, a rejected
    proposal) are sampled without a mask and their results are ignored."""

    def __init__(self, out: StepOutput, batch: ScheduleBatch, sampled: list[int], tensors: dict | None,
                 event: "torch.cuda.Event | None", counts: list[int] | None = None):
        self.out, self.batch, self.sampled, self.tensors, self.event = out, batch, sampled, tensors, event
        self.counts = counts  # sample rows per sampled request (None: one each)
        self.dropped: set[int] = set()
        self.constrained = False  # grammar rows: sampled once the engine has advanced the grammars
        self.deferred: tuple | None = None  # (runner, logits, rows, host rows, sampling batch): not sampled yet
        self.grammar_mask = None  # the GrammarMask its sampling used (the draft runner hands its rows on)

    @property
    def needs_sampling(self) -> bool:
        return self.deferred is not None

    def resolve(self) -> StepOutput:
        if self.deferred is not None:
            self.deferred[0].sample_pending(self)
        if self.event is not None:
            self.event.synchronize()
        out, t = self.out, self.tensors
        if not self.sampled:
            return out
        ids = t["ids"].tolist()
        lps = t["lps"].tolist() if t["lps"] is not None else [None] * len(ids)  # none asked for
        top_ids = t["top_ids"].tolist() if t.get("top_ids") is not None else None
        top_lps = t["top_lps"].tolist() if t.get("top_lps") is not None else None
        counts = self.counts or [1] * len(self.sampled)
        row = 0
        for i, n in zip(self.sampled, counts):
            row += n
            j = row - 1  # the request's last row: its ordinary next-token sample
            if n > 1:
                out.proposal_samples[i] = ids[row - n:row]
                out.proposal_logprobs[i] = lps[row - n:row]
            out.next_token_ids[i] = ids[j]
            out.logprobs[i] = lps[j]
            req = self.batch.reqs[i]
            if top_ids is not None and req.return_logprob and req.top_logprobs_num > 0:
                kk = req.top_logprobs_num
                out.top_logprobs[i] = [[top_lps[j][m], top_ids[j][m]] for m in range(kk)]
                if n > 1:
                    out.proposal_top_logprobs[i] = [[[top_lps[r][m], top_ids[r][m]] for m in range(kk)]
                                                    for r in range(row - n, row)]
        return out


@dataclass
class ForwardPlan:
    """One forward pass as host data: what rank 0 runs and sends to the other tensor-parallel ranks."""
    mode: ForwardMode
    input_ids: list[int]  # empty for decode: those inputs are the last samples, on the device
    req_pool_indices: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor  # host int64
    table_writes: tuple  # req_to_token rows, columns, slots: lists (decode) or int64 arrays (extend)
    prefix_groups: list | None = None
    use_graph: bool = False
    # An extend pass replayed from shared/engine/extend_graph.py: the graph ExtendGraphRunner.pick chose (bucket,
    # long-extend family); None: eager.
    extend_graph: tuple[int, bool] | None = None
    # With use_graph and prefix_groups: their layout for the batch size's shared-prefix graph (rank 0
    # decides; every rank loads the same).
    graph_cascade: object = None

    # The slot ids cross the pipe as a numpy array: pickling a torch tensor costs ~10x more (~250 us).
    def __getstate__(self) -> dict:
        return {**self.__dict__, "out_cache_loc": self.out_cache_loc.numpy()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, out_cache_loc=torch.from_numpy(state["out_cache_loc"]))


def mixed_warmup_passes(config: EngineConfig, max_context_len: int,
                        rider_counts: Callable[[int], list[int]] | None = None) -> list[tuple[int, int, int]]:
    """(prompt tokens, riders, the riders' context) of the prefill passes with running requests riding along
    that the warm-up runs under --enable-mixed-chunk: for each rider count (an attention backend's
    `rider_counts` of the most the scheduler forms; that most alone without one) the longest prompt it leaves
    room for (the scheduler's rules: prefill_adder.max_riders, riders reserved from the pass's budget first, then
    prefill_adder.chunk_len of the rest), then a small pass. None where the context is too short."""
    most = max(1, min(config.max_running_requests, max_riders(config.max_prefill_tokens)))
    ctx = min(32, max_context_len - 2)
    passes = []
    for riders in sorted({min(r, most) for r in (rider_counts(most) if rider_counts else [most])}, reverse=True):
        prompt = chunk_len(max_context_len - 1, config.chunked_prefill_size, config.max_prefill_tokens - riders)
        if ctx >= 1 and prompt >= 1:
            passes.append((prompt, riders, ctx))
    if passes:
        passes.append((min(64, passes[0][0]), min(2, most), ctx))
    return passes


class ModelRunner:
    def __init__(self, config: EngineConfig, tp=None, tp_rank: int = 0):
        """With config.tp_size > 1, rank 0 (tp None) spawns the other ranks (shared/engine/tp.py); each
        of them builds its own ModelRunner with its link to rank 0 and replays rank 0's passes."""
        from shared.models.parallel import set_tp

        self.config = config
        self.tp = tp
        if config.tp_size > 1 and tp is None:
            from shared.engine.tp import TPLeader
            from shared.models.loader import load_config_of
            from shared.models.parallel import TPConfigError, validate_tp

            mc = load_config_of(config.model_path)  # refuse a degree the model cannot split before spawning
            validate_tp(config.tp_size, mc.num_attention_heads, mc.num_key_value_heads, mc.intermediate_size)
            device = resolve_device(config.device)
            if device.type == "cuda" and device.index + config.tp_size > torch.cuda.device_count():
                raise TPConfigError(f"--tp-size {config.tp_size} from {device} needs GPUs {device.index}.."
                                    f"{device.index + config.tp_size - 1}; this host has {torch.cuda.device_count()}")
            self.tp = TPLeader(config, device)
        elif config.tp_size == 1:
            from shared.models.parallel import tp_size

            if tp_size() > 1:  # the rank state is per process: a second model would corrupt the first
                raise RuntimeError("a tensor-parallel model runner is alive in this process; close it first")
            set_tp(0, 1)
        try:
            self._init(config, tp_rank)
        except BaseException:
            self.close()
            raise

    def _init(self, config: EngineConfig, tp_rank: int) -> None:
        from shared.engine.tp import follower_device
        from shared.models.attention import create_attention_backend
        from shared.models.loader import load_model
        from shared.models.parallel import local_heads, local_kv_heads

        self.device = follower_device(config.device, tp_rank) if tp_rank else resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            from kernels._utils import set_pdl

            set_pdl(config.enable_pdl, config.pdl_early_trigger)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.random_seed)
        self.model, self.model_config = load_model(config.model_path, dtype=self.dtype, device=self.device,
                                                   load_format=config.load_format,
                                                   quantization=config.quantization,
                                                   keep_fp8_blocks=not config.dequantize_fp8_blocks)
        if self.tp is not None:
            self.tp.ready()  # every rank has its shard: collectives may start
        # The split norms' kernels and the prefetch are the GPU's; on CPU the torch path would gain nothing.
        on_gpu = self.device.type == "cuda"
        self.decode_norm_fusion = self.model.model.split_row_norms(config.decode_norm_fusion and on_gpu)
        # The KV pool's element type: the model's, or FP8 (scaled by the checkpoint's per-layer k/v scales if any).
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        kv_scales = None
        if self.kv_dtype.itemsize == 1:
            from shared.models.loader import load_kv_scales

            kv_scales = load_kv_scales(config.model_path, self.model_config.num_hidden_layers, config.load_format)
        # The qkv GEMV's rope epilogue writes an FP8 pool only at unit k/v scales (kernels/rope_store.py).
        self.decode_rope_fusion = self.model.model.fuse_row_rope(config.decode_rope_fusion and on_gpu
                                                                 and not kv_scales)
        if config.decode_l2_prefetch and on_gpu:
            from shared.models.weight_prefetch import WeightPrefetcher

            self.model.model.row_prefetcher = WeightPrefetcher(self.device)
        mc = self.model_config
        # This rank's attention heads (tensor parallelism splits them; kv heads may be replicated).
        self.num_heads, self.num_kv_heads = local_heads(mc.num_attention_heads), local_kv_heads(mc.num_key_value_heads)
        self.vocab_size = mc.vocab_size
        self.tokenizer_vocab_size = mc.vocab_size  # the engine lowers it to the tokenizer's size
        self.eos_token_ids: list[int] = list(mc.eos_token_ids)  # the engine adds the tokenizer's
        # context_length honours a sliding window: our attention is full-causal, exact only inside it.
        self.max_context_len = min(config.max_context_len or mc.context_length, mc.context_length)
        self.page_size = config.page_size
        num_tokens, gpu_bytes = self._pool_tokens()
        if self.tp is not None:  # every rank must hold every slot id rank 0 hands out, and size alike
            from shared.models.parallel import all_reduce_min

            num_tokens = all_reduce_min(num_tokens, self.device)
            gpu_bytes = all_reduce_min(gpu_bytes, self.device) if gpu_bytes is not None else None
        num_pages = max(1, num_tokens // self.page_size)
        self.kv_pool = KVPool(mc.num_hidden_layers, self.num_kv_heads, mc.head_dim, num_pages,
                              self.page_size, self.kv_dtype, self.device, kv_scales)
        self.max_total_tokens = num_pages * self.page_size
        # Running requests, graph sizes and prefill chunk where the command line left them unset (sizing.py).
        self.gpu_bytes = gpu_bytes
        config = self.config = self.sized(config)
        self.req_pool = ReqToTokenPool(config.max_running_requests, self.max_context_len, self.device)
        if self.tp is not None and self.tp.is_leader:  # the scheduler's own writes (a prefix deduplicated)
            self.req_pool.on_write = lambda row, start, slots: self.tp.send(("table", row, start, slots.tolist()))
        from shared.constrained import MaskBuilder

        # Mask filling is host work per constrained request; xgrammar spreads it over threads when a
        # batch's fill is large enough to pay for that (MaskBuilder). Rank 0 alone samples.
        self.masker = MaskBuilder(self.vocab_size, max_threads=max(2, min(8, (os.cpu_count() or 2) // 2))) \
            if tp_rank == 0 else None
        # Set to a list to record, per step with grammar masks, (start, end, masked rows, host seconds
        # of the fill): start/end are CUDA events around the fill on a GPU (their gap is the part of the
        # fill the forward did not hide), host clock readings on CPU. bench/structured.py reads it.
        self.mask_timing: list | None = None
        # Last sampled token of each request row, on the device: the next decode step's input.
        self.token_buf = torch.zeros(config.max_running_requests + 1, dtype=torch.int64, device=self.device)
        self.attn_backend = create_attention_backend(
            config.attention_backend, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=mc.head_dim, device=self.device, dtype=self.dtype,
            one_launch_decode=config.one_launch_decode_attention, max_kv_splits=config.triton_attention_num_kv_splits)
        self.attn_backend.cascade_enabled &= not config.disable_shared_prefix_attention
        log.info("model %s on %s (%s): KV pool %d tokens (%s%s), context %d; up to %d running requests, prefill "
                 "chunks of %d", config.model_path, self.device, self.dtype, self.max_total_tokens,
                 str(self.kv_dtype).replace("torch.", ""), ", the checkpoint's k/v scales" if kv_scales else "",
                 self.max_context_len, config.max_running_requests, config.chunked_prefill_size)
        if self.device.type == "cuda":
            self.warmup()
        self.graph_runner = None
        self.extend_graphs = None
        self.graph_stats: dict | None = None  # what capturing the graphs took (engine.info's cuda_graphs)
        if self.device.type == "cuda" and config.cuda_graph:
            self._capture_graphs(config, tp_rank)

    def _capture_graphs(self, config: EngineConfig, tp_rank: int) -> None:
        """The decode and extend CUDA graphs, their capture time and device memory reported in one log line."""
        # Cached blocks go back to the driver before each reading: torch.cuda.graph empties the cache as capture
        # begins, which would otherwise offset the graphs' own memory (a small model's read 0 bytes).
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_before, t0 = torch.cuda.mem_get_info(self.device)[0], time.monotonic()
        if getattr(self.attn_backend, "graph_safe", False):
            from shared.engine.cuda_graph import CudaGraphRunner

            self.graph_runner = CudaGraphRunner(
                self.model, self.kv_pool, self.req_pool.req_to_token, self.token_buf, self.attn_backend,
                max_bs=min(config.cuda_graph_max_bs, config.max_running_requests), device=self.device,
                progress=tp_rank == 0)
        # Not under tensor parallelism yet: those passes would capture collectives in graphs no GPU
        # run of ours has checked.
        if config.tp_size == 1 and getattr(self.attn_backend, "extend_graph_safe", False):
            from shared.engine.extend_graph import ExtendGraphRunner, capture_sizes

            if capture_sizes(config.cuda_graph_max_extend_tokens):
                self.extend_graphs = ExtendGraphRunner(
                    self.model, self.kv_pool, self.req_pool.req_to_token, self.attn_backend,
                    max_tokens=config.cuda_graph_max_extend_tokens, max_reqs=config.max_running_requests,
                    dtype=self.dtype, device=self.device,
                    pool=self.graph_runner.pool if self.graph_runner is not None else None,
                    progress=tp_rank == 0)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        decode = len(self.graph_runner.graphs) if self.graph_runner is not None else 0
        extend = len(self.extend_graphs.graphs) if self.extend_graphs is not None else 0
        self.graph_stats = {"decode_graphs": decode, "extend_graphs": extend,
                            "decode_max_bs": self.graph_runner.max_bs if self.graph_runner is not None else 0,
                            "capture_s": round(time.monotonic() - t0, 2),
                            "memory_bytes": max(0, free_before - torch.cuda.mem_get_info(self.device)[0])}
        log.info("CUDA graphs: %d decode (batch 1..%d) and %d extend captured in %.1f s, %.2f GiB of device memory",
                 decode, self.graph_stats["decode_max_bs"], extend, self.graph_stats["capture_s"],
                 self.graph_stats["memory_bytes"] / 2**30)

    @torch.no_grad()
    def warmup(self) -> None:
        """Compile before serving what the first requests would otherwise wait for: Triton builds a
        kernel variant per integer-argument class (== 1, divisible by 16, other) and the sampler's
        compiled path on first use. Dummy tokens use request row 0 and the padding slot 0."""
        from shared.sampling_params import SamplingParams

        for T in (1, 15, 16, 17, 64, 255):
            if T >= self.max_context_len:
                continue
            fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * T, [0], [0], [T], torch.zeros(T, dtype=torch.int64),
                                    self.req_pool.req_to_token, self.kv_pool, self.attn_backend, self.device)
            self.attn_backend.init_forward_metadata(fb)
            logits = self.model.compute_logits(self.model.forward(fb)[-1:])
        for temperature in (0.0, 1.0):
            sb = SamplingBatch.build(params=[SamplingParams(temperature=temperature)], seeds=[0], steps=[0],
                                     output_ids=[[]], prompt_ids=None, vocab_size=self.vocab_size,
                                     device=self.device)
            sample(logits, sb, top_logprobs_num=1)
        if self.config.enable_mixed_chunk:
            self.warmup_mixed()
        self._warmup_shared_prefix()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warmup_mixed(self) -> None:
        """--enable-mixed-chunk: the prefill passes with riders of `mixed_warmup_passes`, one for each rider count
        the backend runs with a kernel variant of its own, run once so those variants compile here instead of in
        the first live mixed pass (which otherwise compiled two decode-kernel variants and ran much slower:
        docs/kernels.md). Public for an engine that
        turns mixed chunks on over a runner built without them (bench.offline). Dummy tokens use request row 0 and
        the padding slot 0."""
        for prompt, riders, ctx in mixed_warmup_passes(self.config, self.max_context_len,
                                                       self.attn_backend.rider_counts):
            lens = [prompt] + [1] * riders
            fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * sum(lens), [0] * len(lens), [0] + [ctx] * riders, lens,
                                    torch.zeros(sum(lens), dtype=torch.int64), self.req_pool.req_to_token,
                                    self.kv_pool, self.attn_backend, self.device)
            self.attn_backend.init_forward_metadata(fb)
            hidden = self.model.forward(fb)
            self.model.compute_logits(hidden[to_device(np.cumsum(lens) - 1, torch.int64, self.device)])

    def _warmup_shared_prefix(self) -> None:
        """Compile the shared-prefix decode path for the group-size blocks it uses (eager batches, so
        a first-use compile would stall serving). If it cannot run here, it is turned off: plain
        decode attention serves every batch."""
        be = self.attn_backend
        if not be.cascade_enabled or self.max_context_len <= 40:
            return
        try:
            for size in (2, 4, 8, 16, 32):
                if size > self.config.max_running_requests:
                    break
                fb = ForwardBatch.build(ForwardMode.DECODE, [0] * size, [0] * size, [32] * size, [1] * size,
                                        torch.zeros(size, dtype=torch.int64), self.req_pool.req_to_token,
                                        self.kv_pool, be, self.device)
                fb.prefix_groups = [(16, list(range(size)))]
                be.init_forward_metadata(fb)
                out = self.model.forward(fb)
                assert bool(torch.isfinite(out).all()), "non-finite output"
        except Exception:
            log.exception("shared-prefix attention failed its warm-up; it stays off")
            be.cascade_enabled = False

    def shape(self) -> "ModelShape":
        """What the engine's sizes cost outside the KV pool depends on (shared/engine/sizing.py)."""
        from shared.engine.sizing import ModelShape

        mc = self.model_config
        return ModelShape(self.max_context_len, mc.vocab_size, mc.hidden_size, mc.intermediate_size,
                          torch.empty((), dtype=self.dtype).element_size())

    def sized(self, config: EngineConfig, pool_tokens: int | None = None, gpu_bytes: int | None = None) -> EngineConfig:
        """config with the sizes it leaves unset derived for a pool and GPU (default: this runner's) where an
        explicit value wins. An engine on this runner takes its config from here."""
        from shared.engine import sizing

        if pool_tokens is None:
            pool_tokens, gpu_bytes = self.max_total_tokens, self.gpu_bytes
        return sizing.fill(config, sizing.derive_sizes(pool_tokens, gpu_bytes, self.shape()))

    def _pool_tokens(self) -> tuple[int, int | None]:
        """(KV pool tokens, the GPU's total memory or None without one). The pool takes what is free after the
        weights, less the larger of the card's (1 - --mem-fraction-static) and the estimated needs of the
        running requests, graphs and prefill chunk the pool's size implies (sizing.reserve_bytes)."""
        from shared.engine import sizing

        gpu_bytes = torch.cuda.mem_get_info(self.device)[1] if self.device.type == "cuda" else None
        if self.config.max_total_tokens:
            return self.config.max_total_tokens, gpu_bytes
        if gpu_bytes is None:
            return _CPU_DEFAULT_TOKENS, None
        mc = self.model_config
        per_token = KVPool.bytes_per_token(mc.num_hidden_layers, self.num_kv_heads, mc.head_dim, self.kv_dtype)
        free, total = torch.cuda.mem_get_info(self.device)
        # Keep (1 - fraction) of the whole card for activations, graphs and the sampler, or what the sizes the
        # provisional pool implies are estimated to need, if more; sizes derived from the smaller pool only shrink.
        budget = free - total * (1 - self.config.mem_fraction_static)
        filled = self.sized(self.config, int(max(0, budget) // per_token), total)
        sizes = sizing.sizes_of(filled)
        # (PD: the KV buffers of transfers in flight live outside the pool too: room for their budget.)
        reserve = (sizing.reserve_bytes(sizes, self.shape())
                   + sizing.transfer_budget_bytes(filled, self.kv_transfer_token_bytes()))
        budget = free - max(total * (1 - self.config.mem_fraction_static), reserve)
        if self.config.speculative_algorithm == "STANDALONE":
            # The draft runner comes after this pool, with as many tokens of its own (spec/draft.py): leave it room.
            from shared.engine.spec.draft import draft_memory

            draft_per_token, draft_rest = draft_memory(filled, sizes, self.max_context_len, self.shape().act_bytes)
            per_token += draft_per_token
            budget -= draft_rest
        tokens = int(budget // per_token)
        if tokens < 1024:
            raise RuntimeError(
                f"only {max(0, budget) / 2**30:.1f} GiB left for the KV cache after the weights "
                f"({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB); raise --mem-fraction-static "
                f"or set --max-total-tokens")
        return tokens, total

    # ------------------------------------------------------------------ forward
    def close(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0; nothing to do otherwise)."""
        if self.tp is not None and self.tp.is_leader:
            self.drop_graphs()
            self.tp.close()

    def drop_graphs(self) -> None:
        """Destroy the captured CUDA graphs. Under tensor parallelism they hold NCCL collectives, and a
        communicator is torn down only after the graphs that use it are gone (NCCL leaves the other
        order undefined)."""
        if self.graph_runner is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.graph_runner.graphs.clear()
            self.graph_runner = None
        if getattr(self, "extend_graphs", None) is not None:
            self.extend_graphs.clear()
            self.extend_graphs = None

    @staticmethod
    def _table_writes(batch: ScheduleBatch) -> tuple:
        """The slots of this pass's tokens in the request rows (rows, columns, slots). A decode pass writes
        one entry a request, as lists (the graph runner stages them). An extend pass writes the row from the
        first entry no earlier pass wrote (`Req.table_len`): all of it for a newly admitted request (its
        cached prefix is new there), the new tokens only for a running one catching up; as int64 arrays
        built a request at a time (an 8k-token pass's lists cost ~0.3 ms of Python before its first kernel)."""
        if batch.mode == ForwardMode.DECODE:
            rows, cols, vals = [], [], []
            for req, p in zip(batch.reqs, batch.prefix_lens):
                rows.append(req.req_pool_idx)
                cols.append(p)
                vals.append(req.slots[p])
                req.table_len = p + 1
            return rows, cols, vals
        firsts, counts, reqs_rows, parts = [], [], [], []
        for req, p, e in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            first = min(p, req.table_len)
            firsts.append(first)
            counts.append(p + e - first)
            reqs_rows.append(req.req_pool_idx)
            parts.append(req.slots[first:p + e])
            req.table_len = p + e
        n = np.array(counts, dtype=np.int64)
        total = int(n.sum())
        rows = np.repeat(np.array(reqs_rows, dtype=np.int64), n)
        cols = np.arange(total, dtype=np.int64) + np.repeat(np.array(firsts, dtype=np.int64) - (np.cumsum(n) - n), n)
        vals = np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64, count=total)
        return rows, cols, vals

    def _plan(self, batch: ScheduleBatch) -> ForwardPlan:
        decode = batch.mode == ForwardMode.DECODE
        n = batch.batch_size
        # Shared-prefix attention when the backend judges it pays: in the batch size's shared-prefix graph
        # when there is one and the groups fit it, eagerly otherwise.
        groups = self.attn_backend.select_prefix_groups(batch.prefix_groups) if decode else None
        rows = [r.req_pool_idx for r in batch.reqs]
        use_graph = decode and self.graph_runner is not None and self.graph_runner.can_run(n)
        cascade = None
        if use_graph and groups:
            cascade = self.graph_runner.plan_cascade(groups, rows)
            use_graph = cascade is not None
        extend_graph = (self.extend_graphs.pick(batch.extend_lens)
                        if not decode and self.extend_graphs is not None else None)
        return ForwardPlan(
            batch.mode, [] if decode else batch.input_ids, rows, batch.prefix_lens, batch.extend_lens,
            batch.out_cache_loc, self._table_writes(batch), groups, use_graph=use_graph, graph_cascade=cascade,
            extend_graph=extend_graph)

    def _run_plan(self, plan: ForwardPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the slot table, run the model: (the request rows on the device, logits of every row) from
        a CUDA graph, else (the rows, final hidden states)."""
        if plan.use_graph:
            return self._run_graph(plan)
        dev = self.device
        rows, cols, vals = plan.table_writes
        self.req_pool.req_to_token[to_device(rows, torch.int64, dev), to_device(cols, torch.int64, dev)] = \
            to_device(vals, torch.int32, dev)
        decode = plan.mode == ForwardMode.DECODE
        fb = ForwardBatch.build(
            plan.mode, [0] * len(plan.extend_lens) if decode else plan.input_ids, plan.req_pool_indices,
            plan.prefix_lens, plan.extend_lens, plan.out_cache_loc, self.req_pool.req_to_token, self.kv_pool,
            self.attn_backend, dev)
        if decode:
            fb.input_ids = self.token_buf[fb.req_pool_indices]
            fb.prefix_groups = plan.prefix_groups
        elif PENDING_TOKEN in plan.input_ids:
            # A running request riding along in an extend pass with a token still on the device (overlap):
            # its value is the previous step's sample, in token_buf (indices built on the host: no sync).
            # Every rank substitutes it from its own token_buf (rank 0's samples, broadcast).
            rows = [r for r, e in zip(plan.req_pool_indices, plan.extend_lens) for _ in range(e)]
            at = [j for j, t in enumerate(plan.input_ids) if t == PENDING_TOKEN]
            fb.input_ids[to_device(at, torch.int64, dev)] = self.token_buf[to_device([rows[j] for j in at],
                                                                                     torch.int64, dev)]
        if plan.extend_graph is not None:
            return fb.req_pool_indices, self.extend_graphs.run(fb, plan.extend_graph)
        self.attn_backend.init_forward_metadata(fb)
        return fb.req_pool_indices, self.model.forward(fb)

    def _run_graph(self, plan: ForwardPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode pass replayed from its batch size's graph: the step's inputs go over in one copy and
        the graph writes the slot table itself (cuda_graph.py)."""
        rows, cols, vals = plan.table_writes
        # A decode pass writes one entry per request, at its new token's position.
        assert rows == plan.req_pool_indices and cols == plan.prefix_lens, "decode table writes out of order"
        if plan.graph_cascade is not None:
            self.graph_runner.load_cascade(plan.graph_cascade, len(plan.req_pool_indices))
        logits, dev_rows = self.graph_runner.run(
            plan.req_pool_indices, [p + 1 for p in plan.prefix_lens], plan.out_cache_loc, vals,
            cascade=plan.graph_cascade is not None)
        return dev_rows, logits

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits of some rows of hidden; the other ranks compute their vocabulary part alongside."""
        if self.tp is not None:
            self.tp.send(("logits", rows))
        with self._lockstep():
            return self.model.compute_logits(hidden[to_device(rows, torch.int64, self.device)])

    def _lockstep(self):
        """Around rank 0's device work for a command it just sent the other ranks (TPLeader.lockstep)."""
        return self.tp.lockstep() if self.tp is not None else contextlib.nullcontext()

    def follow(self, cmd: tuple) -> None:
        """A tensor-parallel rank > 0: replay one of rank 0's commands (same kernels, same collectives)."""
        from shared.models.parallel import broadcast

        op = cmd[0]
        if op == "forward":
            self._follow_hidden = self._run_plan(cmd[1])[1]
        elif op == "logits":
            self.model.compute_logits(self._follow_hidden[to_device(cmd[1], torch.int64, self.device)])
        elif op == "tokens":
            ids = broadcast(torch.empty(len(cmd[1]), dtype=torch.int64, device=self.device))
            self.token_buf[to_device(cmd[1], torch.int64, self.device)] = ids
        elif op == "table":
            self.req_pool.write(cmd[1], cmd[2], torch.tensor(cmd[3], dtype=torch.int64))
        elif op == "set_token":
            self.token_buf[cmd[1]] = cmd[2]
        elif op in ("kv_gather", "kv_scatter"):
            self._follow_kv(op, cmd[1])
        elif op == "batch":  # commands rank 0 deferred, then the one that sent them
            for c in cmd[1]:
                self.follow(c)
        elif op == "host_copy":
            self.host_tier.copy(*cmd[1:])
        elif op == "host_done":
            self.host_tier.done(cmd[1])
        elif op == "host_pool":
            self._follow_host_pool(cmd[1])
        else:
            raise ValueError(f"unknown tensor-parallel command {op!r}")

    # ------------------------------------------------------------------ the host KV tier
    def host_kv_pool(self, tokens: int):
        """The host tier's pool (shared/cache/host_pool.py) of `tokens` slots of this rank's KV. Under tensor
        parallelism every rank builds one of its own KV heads, the same size, and rank 0's pool orders each of its
        copies on the others for the same slots (LeaderHostKVPool). Raises HostTierError where a rank cannot."""
        from shared.cache.host_pool import HostKVPool, HostTierError, LeaderHostKVPool

        if self.tp is None:
            return HostKVPool(self.kv_pool, tokens)
        from shared.models.parallel import all_reduce_min

        self.tp.send(("host_pool", tokens))
        pool = error = None
        try:
            pool = LeaderHostKVPool(self.kv_pool, tokens, self.tp.defer, self.tp.send)
        except Exception as e:  # (every rank still takes part in the agreement below)
            error = e
        if not all_reduce_min(int(error is None), self.device):
            raise error or HostTierError("a tensor-parallel rank could not set up its host KV tier (its log says why)")
        return pool

    def _follow_host_pool(self, tokens: int) -> None:
        from shared.cache.host_pool import FollowerHostTier, HostKVPool
        from shared.models.parallel import all_reduce_min

        self.host_tier = None
        try:
            self.host_tier = FollowerHostTier(HostKVPool(self.kv_pool, tokens))
        except Exception:
            log.exception("host KV tier: this rank's pool of %d tokens could not be set up", tokens)
        all_reduce_min(int(self.host_tier is not None), self.device)

    # ------------------------------------------------------------------ KV pages for PD (whole model)
    def kv_layout(self) -> list[int]:
        """One token's KV as it travels between PD workers: every kv head of the model, so the two
        pools may be sharded differently (or not at all)."""
        mc = self.model_config
        return [mc.num_hidden_layers, 2, mc.num_key_value_heads, mc.head_dim]

    def kv_transfer_token_bytes(self) -> int:
        """Bytes of one token's KV in a PD transfer buffer (kv_layout, the whole model's heads)."""
        return math.prod(self.kv_layout()) * self.kv_dtype.itemsize

    def weight_format(self) -> str:
        """How the decoder's linear weights are held: the model dtype, or FP8 e4m3 with scales per row or per
        [bn, bk] block (engine.info's `weight_format`: whether a block-scaled checkpoint kept its blocks)."""
        from shared.models.layers import Linear

        for name, module in self.model.named_modules():
            if isinstance(module, Linear) and name != "lm_head":
                if module.weight_scale is None:
                    return str(module.weight.dtype).replace("torch.", "")
                if module.weight_block is None:
                    return "fp8_e4m3, a scale per row"
                return "fp8_e4m3, a scale per [{}, {}] block".format(*module.weight_block)
        return str(self.dtype).replace("torch.", "")

    def kv_format(self) -> str:
        """kv_layout and the pool's dtype in one string, as PD workers compare them before pairing."""
        from shared.pd import kv_pages

        return f"{'x'.join(map(str, self.kv_layout()))} {kv_pages.dtype_name(self.kv_dtype)}"

    def empty_kv_buffer(self, tokens: int, staging: str = "device") -> torch.Tensor:
        """Where `tokens` positions of whole-model KV are received."""
        from shared.pd import kv_pages

        return kv_pages.empty_buffer(self.kv_layout(), self.kv_dtype, self.device, tokens, staging)

    def gather_kv(self, slots: torch.Tensor, staging: str = "device") -> torch.Tensor:
        """Whole-model KV at `slots` -> one contiguous buffer (kv_pages' token-major layout). Under
        tensor parallelism every rank gathers its heads and rank 0 assembles them."""
        from shared.pd import kv_pages

        if self.tp is None:
            return kv_pages.gather(self.kv_pool, slots, staging)
        from shared.models.parallel import all_gather_kv_heads

        self.tp.send(("kv_gather", slots.tolist()))
        with self.tp.lockstep():
            full = all_gather_kv_heads(kv_pages.gather(self.kv_pool, slots), self.model_config.num_key_value_heads)
        return kv_pages.staged(full, staging)

    def scatter_kv(self, slots: torch.Tensor, buf: torch.Tensor) -> None:
        """Write whole-model KV into the pool at `slots`; under tensor parallelism rank 0 broadcasts it
        and every rank keeps its heads."""
        from shared.pd import kv_pages

        if self.tp is None:
            kv_pages.scatter(self.kv_pool, slots, buf)
            return
        from shared.models.parallel import broadcast, local_kv_part

        shape = (len(slots), *self.kv_layout())
        if tuple(buf.shape) != shape or buf.dtype != self.kv_dtype:  # before the broadcast, whose size it sets
            raise ValueError(f"KV buffer of {tuple(buf.shape)} {kv_pages.dtype_name(buf.dtype)} does not fit "
                             f"{len(slots)} slots of this pool ({shape} {kv_pages.dtype_name(self.kv_dtype)})")
        # On the device before the command: out of memory here ends the request, inside lockstep the worker.
        buf = buf.to(self.device, non_blocking=True).contiguous()
        self.tp.send(("kv_scatter", slots.tolist()))
        with self.tp.lockstep():
            full = broadcast(buf)
        kv_pages.scatter(self.kv_pool, slots, local_kv_part(full, self.model_config.num_key_value_heads))

    def _follow_kv(self, op: str, slots: list[int]) -> None:
        from shared.models.parallel import all_gather_kv_heads, broadcast, local_kv_part
        from shared.pd import kv_pages

        loc = torch.tensor(slots, dtype=torch.int64)
        heads = self.model_config.num_key_value_heads
        if op == "kv_gather":
            all_gather_kv_heads(kv_pages.gather(self.kv_pool, loc), heads)
        else:
            full = broadcast(self.empty_kv_buffer(len(slots)))
            kv_pages.scatter(self.kv_pool, loc, local_kv_part(full, heads))

    def forward(self, batch: ScheduleBatch) -> StepOutput:
        return self.launch(batch).resolve()

    def launch(self, batch: ScheduleBatch) -> PendingStep:
        """Enqueue the forward pass and sampling; return without waiting for the device. Decode input
        ids are read on the device from the previous step's samples (token_buf), so the host need not
        know them yet."""
        plan = self._plan(batch)
        if self.tp is not None:
            self.tp.send(("forward", plan))
        with self._lockstep():
            dev_rows, result = self._run_plan(plan)
        n = batch.batch_size
        out = StepOutput([None] * n, [None] * n, [None] * n, [None] * n, [None] * n)
        if plan.use_graph:
            return self._sample(batch, result, list(range(n)), out, dev_rows, plan.req_pool_indices)
        hidden = result
        ends, acc = [], 0
        for e in batch.extend_lens:
            acc += e
            ends.append(acc - 1)
        # A prefill-only request (max_new_tokens 0) is sampled only to report the next position's top-k.
        sampled = [i for i in range(n) if batch.sample[i] and (batch.reqs[i].params.max_new_tokens > 0 or (
            batch.reqs[i].return_logprob and batch.reqs[i].top_logprobs_num > 0))]
        if batch.mode == ForwardMode.EXTEND:
            self._input_logprobs(batch, hidden, out)
        if not sampled:
            return PendingStep(out, batch, [], {}, None)
        # A request carrying k proposed tokens is sampled at each of them and after the last.
        counts = [batch.reqs[i].proposed + 1 for i in sampled]
        rows = [ends[i] - c + 1 + m for i, c in zip(sampled, counts) for m in range(c)]
        return self._sample(batch, self._logits(hidden, rows), sampled, out, dev_rows, plan.req_pool_indices,
                            counts if any(c > 1 for c in counts) else None)

    def _sample(self, batch: ScheduleBatch, logits: torch.Tensor, sampled: list[int], out: StepOutput,
                dev_rows: torch.Tensor, host_rows: list[int], counts: list[int] | None = None) -> PendingStep:
        """The forward is enqueued; sample one row per request, or, for a request with proposals, one
        row per proposal position plus one (`counts`); row m of such a request is its sample after m
        proposals. Without grammars sampling is enqueued now; with them it waits for `sample_pending`
        (the engine calls it once the grammars have taken the previous step's tokens; `resolve` does
        if nobody did), and the host fills the masks then, while the device runs this forward. dev_rows /
        host_rows: the batch's request rows on the device and the host (a graph pass's device rows are its
        static buffer: sampling is enqueued before the next pass launches, shared/engine/engine_loop.py)."""
        reqs = [batch.reqs[i] for i in sampled]
        if counts is None:
            rows_req, rows_step = reqs, [len(r.output_ids) for r in reqs]
        else:
            # Output before the proposals is len(output_ids) - k; row m samples step base + m.
            rows_req = [r for r, c in zip(reqs, counts) for _ in range(c)]
            rows_step = [len(r.output_ids) - c + 1 + m for r, c in zip(reqs, counts) for m in range(c)]
        sb = SamplingBatch.build(
            params=[r.params for r in rows_req], seeds=[r.seed for r in rows_req], steps=rows_step,
            output_ids=[r.output_ids for r in reqs] if counts is None else
            # Penalties alone read a row's history: the others' are not copied (a verification pass of
            # k drafts has k + 1 rows a request).
            [r.output_ids[:st] if penalized(r.params) else r.output_ids for r, st in zip(rows_req, rows_step)],
            prompt_ids=[r.input_ids for r in rows_req] if any(r.params.repetition_penalty != 1.0 for r in reqs) else None,
            vocab_size=self.vocab_size, device=self.device,
            eos_ids=[self._stop_ids(r) for r in rows_req],
            min_new_tokens_active=[st < r.params.min_new_tokens for r, st in zip(rows_req, rows_step)])
        handle = PendingStep(out, batch, sampled, None, None, counts)
        handle.deferred = (self, logits, dev_rows, host_rows, sb)
        if any(r.grammar is not None for r in reqs):
            handle.constrained = True
            return handle
        self.sample_pending(handle)
        return handle

    def sample_pending(self, handle: PendingStep) -> None:
        """Fill the grammar masks (host), then enqueue sampling and the copy of its results."""
        _, logits, dev_rows, host_rows, sb = handle.deferred
        handle.deferred = None
        batch, sampled, counts = handle.batch, handle.sampled, handle.counts
        if self.tokenizer_vocab_size < logits.shape[-1]:
            # Padded embedding rows have no text: never sample them.
            logits[:, self.tokenizer_vocab_size:] = float("-inf")
        reqs = [batch.reqs[i] for i in sampled]
        # Rows whose result will be ignored take no mask: dropped ones, and requests already finished.
        live = [i not in handle.dropped and not batch.reqs[i].finished for i in sampled]
        want_logprobs = any(r.return_logprob for r in reqs)
        k = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        vocab_mask = self._grammar_masks(handle, reqs, live, logits.device)
        res = sample(logits, sb, top_logprobs_num=k, vocab_mask=vocab_mask, logprobs=want_logprobs)
        last_rows = res.next_token_ids
        if counts is not None:
            ends = torch.tensor(counts).cumsum(0) - 1
            last_rows = res.next_token_ids[to_device(ends, torch.int64, self.device)]
        if handle.dropped:
            # A dropped row's next input may have been set on the host (set_last_token): keep it.
            keep = [m for m, i in enumerate(sampled) if i not in handle.dropped]
            last_rows = last_rows[to_device(keep, torch.int64, self.device)]
            sampled = [sampled[m] for m in keep]
        rows = dev_rows if len(sampled) == batch.batch_size else dev_rows[to_device(sampled, torch.int64, self.device)]
        if self.tp is not None:  # every rank feeds rank 0's samples into the next step
            from shared.models.parallel import broadcast

            # The rows as launched: a request that finished meanwhile has given its row back.
            self.tp.send(("tokens", [host_rows[i] for i in sampled]))
            with self.tp.lockstep():
                last_rows = broadcast(last_rows.to(torch.int64).contiguous())
        self.token_buf[rows] = last_rows
        tensors = {"ids": res.next_token_ids, "lps": res.logprobs, "top_ids": res.top_logprobs_ids,
                   "top_lps": res.top_logprobs}
        event = None
        if self.device.type == "cuda":
            # Pinned destinations: a pageable D2H copy would block the CPU until the GPU reached it.
            tensors = {k: (torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
                           if v is not None else None) for k, v in tensors.items()}
            event = torch.cuda.Event()
            event.record()
        handle.tensors, handle.event = tensors, event

    def _grammar_masks(self, handle: PendingStep, reqs: list[Req], live: list[bool],
                       device: torch.device) -> torch.Tensor | None:
        """bool [rows, V] of allowed tokens for the sampler, or None when no row is constrained."""
        counts = handle.counts
        states = [r.grammar if ok else None for r, ok in zip(reqs, live)]
        if not any(s is not None for s in states) and (
                counts is None or all(r.proposal_masks is None for r in reqs)):
            return None  # unconstrained (drafts of unconstrained requests carry no masks)
        timing = self.mask_timing
        if timing is not None:
            t0 = time.perf_counter()
            start = t0
            if self.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                start.record()
        if counts is not None:
            vocab_mask = self._proposal_masks(reqs, live, counts, device)
            rows = sum(counts)
        else:
            mask = handle.grammar_mask = self.masker.build(states, device=device)
            vocab_mask = mask.to_bool() if mask is not None else None
            rows = len(mask.rows) if mask is not None else 0
        if timing is not None:
            end = time.perf_counter()
            host_s = end - t0
            if self.device.type == "cuda":
                end = torch.cuda.Event(enable_timing=True)
                end.record()
            timing.append((start, end, rows, host_s))
        return vocab_mask

    def _proposal_masks(self, reqs: list[Req], live: list[bool], counts: list[int],
                        device: torch.device) -> torch.Tensor:
        """Allowed tokens per sample row: stored masks for proposal positions (made with the
        proposals), the grammar's current mask for other constrained requests."""
        from shared.constrained import bitmask_to_bool

        width = (self.vocab_size + 31) // 32
        bitmask = torch.full((sum(counts), width), -1, dtype=torch.int32)
        row = 0
        for r, ok, c in zip(reqs, live, counts):
            if c > 1:
                if r.proposal_masks is not None:  # unconstrained drafts: every token allowed
                    bitmask[row:row + c] = r.proposal_masks
            elif ok and r.grammar is not None and not r.grammar.is_terminated():
                r.grammar.fill_bitmask(bitmask, row)
            row += c
        return bitmask_to_bool(to_device(bitmask, torch.int32, device), self.vocab_size)

    def set_last_token(self, req_pool_idx: int, token_id: int) -> None:
        """Correct a request's next decode input on every rank (a verified proposal was rejected, a
        jump-forward replaced the sample)."""
        if self.tp is not None:
            self.tp.send(("set_token", req_pool_idx, token_id))
        self.token_buf[req_pool_idx] = token_id

    def _stop_ids(self, req: Req) -> list[int]:
        ids = list(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            ids.extend(self.eos_token_ids)
        return ids

    def _input_logprobs(self, batch: ScheduleBatch, hidden: torch.Tensor, out: StepOutput) -> None:
        """Logprob of each prompt token from logprob_start_len on, computed from the previous position."""
        start = 0
        for i, (req, p, e) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
            if req.wants_input_logprobs and p < len(req.input_ids):
                s = req.logprob_start_len
                entries: list = []
                tops: list = []
                if p == 0 and s == 0:
                    entries.append([None, req.input_ids[0]])
                    tops.append(None)
                # Row j (absolute position p + j) predicts the token at p + j + 1.
                rows = [j for j in range(e) if s <= p + j + 1 < len(req.input_ids)]
                for c in range(0, len(rows), _LOGPROB_CHUNK):
                    chunk = rows[c:c + _LOGPROB_CHUNK]
                    lp = torch.log_softmax(self._logits(hidden, [start + j for j in chunk]), dim=-1)
                    targets = torch.tensor([req.input_ids[p + j + 1] for j in chunk], device=self.device)
                    chosen = lp.gather(1, targets[:, None]).squeeze(1).tolist()
                    tgt = targets.tolist()
                    entries.extend([[chosen[t], tgt[t]] for t in range(len(chunk))])
                    if req.top_logprobs_num > 0:
                        tv, ti = lp.topk(req.top_logprobs_num, dim=-1)
                        tv, ti = tv.tolist(), ti.tolist()
                        tops.extend([[[tv[t][m], ti[t][m]] for m in range(len(ti[t]))] for t in range(len(chunk))])
                    else:
                        tops.extend([None] * len(chunk))
                out.input_logprobs[i] = entries
                out.input_top_logprobs[i] = tops
            start += e
