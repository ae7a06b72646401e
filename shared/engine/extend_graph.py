"""CUDA graphs for short extend passes: a few new tokens per request over cached prefixes.

Jump-forward's catch-up passes (every running request plus its forced tokens), verify-mode proposal
checks and a turn appended to a cached conversation are extend passes of a few hundred tokens. Eagerly
such a pass is launch-bound: ~300 kernel launches from Python cost ~20 ms of host time for the 8B
shape, about what the device needs to run them, so the GPU waits on the launcher. A
replay is one launch.

One graph per token-count bucket, captured at start-up; a pass is padded up to the next bucket. The
padded batch has `max_reqs(bucket)` request rows and bounds every request at MAX_EXTEND_LEN new tokens
(the extend attention's grid); passes that exceed either run eagerly. Padding tokens write the padding
slot 0 at position 0; padding request rows have no new tokens, so attention skips them, and their hidden
rows are never read. The graph stops at the final hidden states: the caller picks the rows it samples
(last tokens, proposal positions, input logprobs) as after an eager pass.

A second family, the long-extend graphs (LONG_MAX_TOKENS, 512), takes passes of at most LONG_REQS
requests with more new tokens each: a few-shot prompt or a document appended to a program's cached state, alone or
with a fork's siblings. One graph per bucket above MAX_EXTEND_LEN, its attention grid bounded by the whole bucket a
request. Eagerly these passes are host-bound too while the device time is short (a few hundred tokens at the 8B
shape; further with FP8 weights, whose GEMMs halve the device time while their activation quantization adds a
launch a linear).
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from shared.engine.cuda_graph import capture_graphs
from shared.models.forward_batch import ForwardBatch, ForwardMode
from shared.knobs import knob

log = logging.getLogger(__name__)

MAX_EXTEND_LEN = 64  # new tokens of one request a captured pass holds
MAX_REQS = 256  # request rows of the largest buckets (empty rows still launch attention programs)
# The long-extend graphs: buckets above MAX_EXTEND_LEN up to this many tokens (0: none; --cuda-graph-max-extend-tokens
# bounds them too), LONG_REQS request rows each; read when the graphs are captured. A short prompt's prefill replayed
# rather than run eagerly (docs/kernels.md).
LONG_MAX_TOKENS = knob("LONG_MAX_TOKENS")
LONG_REQS = knob("LONG_REQS")
_SIZES = [16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536,
          1792, 2048, 2560, 3072, 3584, 4096]


def capture_sizes(max_tokens: int) -> list[int]:
    """Token-count buckets up to max_tokens (none below the smallest)."""
    return [s for s in _SIZES if s <= max_tokens]


class ExtendGraphRunner:
    def __init__(self, model, kv_pool, req_to_token: torch.Tensor, attn_backend, max_tokens: int,
                 max_reqs: int, dtype: torch.dtype, device: torch.device, pool=None, progress: bool = True):
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.attn_backend = attn_backend
        self.device = device
        self.sizes = capture_sizes(max_tokens)
        self.req_cap = max(1, min(max_reqs, MAX_REQS))
        self.long_reqs = min(LONG_REQS, self.req_cap)
        self.long_sizes = [s for s in self.sizes if MAX_EXTEND_LEN < s <= LONG_MAX_TOKENS]
        n, r = self.sizes[-1], self.req_cap
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.out_cache_loc = torch.zeros(n, **i64)
        self.req_pool_indices = torch.zeros(r, **i64)
        self.seq_lens = torch.zeros(r, **i32)
        self.prefix_lens = torch.zeros(r, **i32)
        self.extend_lens = torch.zeros(r, **i32)
        self.start_loc = torch.zeros(r, **i32)
        # One output buffer every graph copies its hidden states into, so that no graph keeps its own
        # output alive in the pool (the graphs' intermediates share the same memory).
        self.hidden = torch.empty(n, model.config.hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.long_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by bucket: the long-extend family
        self.pool = pool
        self._capture_all(progress)

    def max_reqs(self, tokens: int) -> int:
        return min(tokens, self.req_cap)

    def _rows(self, tokens: int, long: bool) -> int:
        return self.long_reqs if long else self.max_reqs(tokens)

    def _batch(self, tokens: int, long: bool = False) -> ForwardBatch:
        r = self._rows(tokens, long)
        return ForwardBatch(
            mode=ForwardMode.EXTEND, batch_size=r, input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens], req_pool_indices=self.req_pool_indices[:r],
            seq_lens=self.seq_lens[:r], extend_prefix_lens=self.prefix_lens[:r],
            extend_seq_lens=self.extend_lens[:r], extend_start_loc=self.start_loc[:r],
            out_cache_loc=self.out_cache_loc[:tokens], req_to_token=self.req_to_token, kv_pool=self.kv_pool,
            attn_backend=self.attn_backend, max_extend_len=tokens if long else min(tokens, MAX_EXTEND_LEN))

    def _forward(self, tokens: int, long: bool = False) -> None:
        fb = self._batch(tokens, long)
        self.attn_backend.init_forward_metadata(fb)
        self.hidden[:tokens].copy_(self.model.forward(fb))

    def _capture_all(self, progress: bool) -> None:
        t0 = time.monotonic()
        graphs, self.pool = capture_graphs(
            list(reversed(self.sizes)), self._forward, self.device, self.pool, "Capturing extend CUDA graphs",
            progress, lambda tokens: f"out of GPU memory capturing the extend CUDA graph of {tokens} tokens beside "
                                     f"the KV pool; lower --cuda-graph-max-extend-tokens (0: none) or "
                                     f"--mem-fraction-static")
        self.graphs.update(graphs)
        if self.long_sizes:
            graphs, self.pool = capture_graphs(
                list(reversed(self.long_sizes)), lambda tokens: self._forward(tokens, long=True), self.device,
                self.pool, "Capturing long-extend CUDA graphs", progress,
                lambda tokens: f"out of GPU memory capturing the long-extend CUDA graph of {tokens} tokens beside the "
                               f"KV pool; lower --cuda-graph-max-extend-tokens or --mem-fraction-static")
            self.long_graphs.update(graphs)
        log.debug("captured %d extend graphs (to %d tokens) and %d long-extend graphs in %.1fs", len(self.sizes),
                 self.sizes[-1], len(self.long_sizes), time.monotonic() - t0)

    def clear(self) -> None:
        """Destroy every captured graph."""
        self.graphs.clear()
        self.long_graphs.clear()

    def bucket(self, tokens: int) -> int | None:
        i = bisect.bisect_left(self.sizes, tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def pick(self, extend_lens: list[int]) -> tuple[int, bool] | None:
        """The captured graph an extend pass of these per-request new-token counts fits: (its token bucket,
        whether it is a long-extend graph), or None."""
        if not extend_lens:
            return None
        tokens = self.bucket(sum(extend_lens))
        if tokens is None:
            return None
        if tokens in self.graphs and len(extend_lens) <= self.max_reqs(tokens) and max(extend_lens) <= MAX_EXTEND_LEN:
            return tokens, False
        if tokens in self.long_graphs and len(extend_lens) <= self.long_reqs:
            return tokens, True
        return None

    def run(self, fb: ForwardBatch, graph: tuple[int, bool]) -> torch.Tensor:
        """The pass of an eagerly built batch (device tensors) through the graph pick chose for it:
        final hidden states [fb.num_tokens, hidden]. They live in the runner's output buffer: enqueue
        what reads them before the next pass is launched (the next replay overwrites them)."""
        t, b = fb.num_tokens, fb.batch_size
        tokens, long = graph
        r = self._rows(tokens, long)
        for buf, src, pad in ((self.input_ids, fb.input_ids, 0), (self.positions, fb.positions, 0),
                              (self.out_cache_loc, fb.out_cache_loc, 0)):
            buf[:t].copy_(src)
            if t < tokens:
                buf[t:tokens].fill_(pad)
        for buf, src in ((self.req_pool_indices, fb.req_pool_indices), (self.seq_lens, fb.seq_lens),
                         (self.prefix_lens, fb.extend_prefix_lens), (self.extend_lens, fb.extend_seq_lens),
                         (self.start_loc, fb.extend_start_loc)):
            buf[:b].copy_(src)
            if b < r:
                buf[b:r].zero_()
        (self.long_graphs if long else self.graphs)[tokens].replay()
        return self.hidden[:t]
