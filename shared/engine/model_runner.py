"""Owns the model, the KV memory and the attention backend; turns a ScheduleBatch into sampled tokens."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from shared.cache.kv_pool import KVPool, ReqToTokenPool
from shared.engine.config import EngineConfig
from shared.engine.forward_batch import ForwardBatch, ForwardMode
from shared.engine.h2d import to_device
from shared.engine.request import Req
from shared.engine.sampler import SamplingBatch, sample
from shared.engine.scheduler import ScheduleBatch

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

    def __post_init__(self):
        self.proposal_samples, self.proposal_logprobs = {}, {}


class PendingStep:
    """A launched step: device work enqueued, results copied to the host asynchronously. `resolve()`
    waits for them; until then the CPU is free to schedule and launch the next step."""

    def __init__(self, out: StepOutput, batch: ScheduleBatch, sampled: list[int], tensors: dict,
                 event: "torch.cuda.Event | None", counts: list[int] | None = None):
        self.out, self.batch, self.sampled, self.tensors, self.event = out, batch, sampled, tensors, event
        self.counts = counts  # sample rows per sampled request (None: one each)

    def resolve(self) -> StepOutput:
        if self.event is not None:
            self.event.synchronize()
        out, t = self.out, self.tensors
        if not self.sampled:
            return out
        ids = t["ids"].tolist()
        lps = t["lps"].tolist()
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
        return out


class ModelRunner:
    def __init__(self, config: EngineConfig):
        from shared.models.attention import create_attention_backend
        from shared.models.loader import load_model

        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.random_seed)
        self.model, self.model_config = load_model(config.model_path, dtype=self.dtype, device=self.device,
                                                   load_format=config.load_format,
                                                   quantization=config.quantization)
        mc = self.model_config
        self.vocab_size = mc.vocab_size
        self.tokenizer_vocab_size = mc.vocab_size  # the engine lowers it to the tokenizer's size
        self.eos_token_ids: list[int] = list(mc.eos_token_ids)  # the engine adds the tokenizer's
        # context_length honours a sliding window: our attention is full-causal, exact only inside it.
        self.max_context_len = min(config.max_context_len or mc.context_length, mc.context_length)
        self.page_size = config.page_size
        num_tokens = self._pool_tokens()
        num_pages = max(1, num_tokens // self.page_size)
        self.kv_pool = KVPool(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, num_pages,
                              self.page_size, self.dtype, self.device)
        self.max_total_tokens = num_pages * self.page_size
        self.req_pool = ReqToTokenPool(config.max_running_requests, self.max_context_len, self.device)
        from shared.constrained import MaskBuilder

        # Mask filling is host work per constrained request; xgrammar spreads it over threads.
        self.masker = MaskBuilder(self.vocab_size, max_threads=max(2, min(8, (os.cpu_count() or 2) // 2)))
        # Last sampled token of each request row, on the device: the next decode step's input.
        self.token_buf = torch.zeros(config.max_running_requests + 1, dtype=torch.int64, device=self.device)
        self.attn_backend = create_attention_backend(
            config.attention_backend, num_heads=mc.num_attention_heads, num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim, device=self.device)
        self.attn_backend.cascade_enabled &= not config.disable_shared_prefix_attention
        log.info("model %s on %s (%s): KV pool %d tokens, context %d", config.model_path, self.device,
                 self.dtype, self.max_total_tokens, self.max_context_len)
        if self.device.type == "cuda":
            self.warmup()
        self.graph_runner = None
        if self.device.type == "cuda" and config.cuda_graph and getattr(self.attn_backend, "graph_safe", False):
            from shared.engine.cuda_graph import CudaGraphRunner

            self.graph_runner = CudaGraphRunner(
                self.model, self.kv_pool, self.req_pool.req_to_token, self.attn_backend,
                max_bs=min(config.cuda_graph_max_bs, config.max_running_requests), device=self.device)

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
        self._warmup_shared_prefix()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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

    def _pool_tokens(self) -> int:
        if self.config.max_total_tokens:
            return self.config.max_total_tokens
        mc = self.model_config
        per_token = KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, self.dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Keep (1 - fraction) of the whole card for activations, graphs and the sampler.
            budget = free - total * (1 - self.config.mem_fraction_static)
            tokens = int(budget // per_token)
            if tokens < 1024:
                raise RuntimeError(
                    f"only {max(0, budget) / 2**30:.1f} GiB left for the KV cache after the weights "
                    f"({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB); raise --mem-fraction-static "
                    f"or set --max-total-tokens")
            return tokens
        return _CPU_DEFAULT_TOKENS

    # ------------------------------------------------------------------ forward
    def _write_req_to_token(self, batch: ScheduleBatch) -> None:
        """Record the slots of this pass's tokens in the request rows, in one indexed store. An extend
        pass writes the whole row up to its end: a newly admitted request's cached prefix is new there."""
        rows, cols, vals = [], [], []
        for req, p, e in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            first = p if batch.mode == ForwardMode.DECODE else 0
            rows.extend([req.req_pool_idx] * (p + e - first))
            cols.extend(range(first, p + e))
            vals.extend(req.slots[first:p + e])
        dev = self.device
        self.req_pool.req_to_token[to_device(rows, torch.int64, dev), to_device(cols, torch.int64, dev)] = \
            to_device(vals, torch.int32, dev)

    def forward(self, batch: ScheduleBatch) -> StepOutput:
        return self.launch(batch).resolve()

    def launch(self, batch: ScheduleBatch) -> PendingStep:
        """Enqueue the forward pass and sampling; return without waiting for the device. Decode input
        ids are read on the device from the previous step's samples (token_buf), so the host need not
        know them yet."""
        self._write_req_to_token(batch)
        decode = batch.mode == ForwardMode.DECODE
        fb = ForwardBatch.build(
            batch.mode, [0] * batch.batch_size if decode else batch.input_ids,
            [r.req_pool_idx for r in batch.reqs], batch.prefix_lens,
            batch.extend_lens, batch.out_cache_loc, self.req_pool.req_to_token, self.kv_pool,
            self.attn_backend, self.device)
        if decode:
            fb.input_ids = self.token_buf[fb.req_pool_indices]
            # Shared-prefix attention when the backend judges it pays; such batches are not graph-captured.
            fb.prefix_groups = self.attn_backend.select_prefix_groups(batch.prefix_groups)
        n = batch.batch_size
        out = StepOutput([None] * n, [None] * n, [None] * n, [None] * n, [None] * n)
        if decode and self.graph_runner is not None and self.graph_runner.can_run(n) and not fb.prefix_groups:
            logits = self.graph_runner.run(fb.input_ids, fb.positions, fb.req_pool_indices, fb.seq_lens,
                                           fb.out_cache_loc)
            return self._sample(batch, logits, list(range(n)), out, fb)
        self.attn_backend.init_forward_metadata(fb)
        hidden = self.model.forward(fb)
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
        rows = to_device([ends[i] - c + 1 + m for i, c in zip(sampled, counts) for m in range(c)],
                         torch.int64, self.device)
        return self._sample(batch, self.model.compute_logits(hidden[rows]), sampled, out, fb,
                            counts if any(c > 1 for c in counts) else None)

    def _sample(self, batch: ScheduleBatch, logits: torch.Tensor, sampled: list[int], out: StepOutput,
                fb: ForwardBatch, counts: list[int] | None = None) -> PendingStep:
        """Sample one row per request, or, for a request with proposals, one row per proposal
        position plus one (`counts`); row m of such a request is its sample after m proposals."""
        if self.tokenizer_vocab_size < logits.shape[-1]:
            # Padded embedding rows have no text: never sample them.
            logits[:, self.tokenizer_vocab_size:] = float("-inf")
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
            [r.output_ids[:st] for r, st in zip(rows_req, rows_step)],
            prompt_ids=[r.input_ids for r in rows_req] if any(r.params.repetition_penalty != 1.0 for r in reqs) else None,
            vocab_size=self.vocab_size, device=self.device,
            eos_ids=[self._stop_ids(r) for r in rows_req],
            min_new_tokens_active=[st < r.params.min_new_tokens for r, st in zip(rows_req, rows_step)])
        k = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        vocab_mask = None
        if counts is not None:
            vocab_mask = self._proposal_masks(reqs, counts, logits.device)
        elif any(r.grammar is not None for r in reqs):
            mask = self.masker.build([r.grammar for r in reqs], device=logits.device)
            vocab_mask = mask.to_bool() if mask is not None else None
        res = sample(logits, sb, top_logprobs_num=k, vocab_mask=vocab_mask)
        last_rows = res.next_token_ids
        if counts is not None:
            ends = torch.tensor(counts).cumsum(0) - 1
            last_rows = res.next_token_ids[to_device(ends, torch.int64, self.device)]
        rows = fb.req_pool_indices if len(sampled) == batch.batch_size else \
            fb.req_pool_indices[to_device(sampled, torch.int64, self.device)]
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
        return PendingStep(out, batch, sampled, tensors, event, counts)

    def _proposal_masks(self, reqs: list[Req], counts: list[int], device: torch.device) -> torch.Tensor:
        """Allowed tokens per sample row: stored masks for proposal positions (filled when the
        proposals were made), the grammar's current mask for other constrained requests."""
        from shared.constrained import bitmask_to_bool

        width = next(r.proposal_masks.shape[1] for r, c in zip(reqs, counts) if c > 1)
        bitmask = torch.full((sum(counts), width), -1, dtype=torch.int32)
        row = 0
        for r, c in zip(reqs, counts):
            if c > 1:
                bitmask[row:row + c] = r.proposal_masks
            elif r.grammar is not None and not r.grammar.is_terminated():
                r.grammar.fill_bitmask(bitmask, row)
            row += c
        return bitmask_to_bool(to_device(bitmask, torch.int32, device), self.vocab_size)

    def set_last_token(self, req_pool_idx: int, token_id: int) -> None:
        """Correct a request's next decode input (a verified proposal was rejected)."""
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
                    idx = torch.tensor([start + j for j in chunk], device=self.device)
                    lp = torch.log_softmax(self.model.compute_logits(hidden[idx]), dim=-1)
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
