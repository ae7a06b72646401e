"""CUDA graphs for decode: one graph per batch size bucket, captured at start-up; a batch is padded up
to the next captured size. Eager decode on a GPU is launch-bound (hundreds of kernels per step at
~10 µs each), a replay is one launch. Where the attention backend can capture shared-prefix (cascade)
decode, batch sizes from CASCADE_MIN_BS get a second graph that reads the batch's prefix groups from
the backend's static buffers.

A step's inputs reach the graph in one host-to-device copy: four numbers per request (its slot-table
row, context length, new KV slot, slot-table entry) into a static block that the graph's first kernel
unpacks (kernels/decode_inputs.py): the input tokens are gathered there from the runner's last samples,
and the slot table is written there. Between two replays the device runs that copy, the sampling and
the copy of its result, nothing else.

Padding rows point at request row 0 (all zeros in req_to_token -> slot 0, the reserved padding slot)
with seq_len 1, so they read and write only the padding slot.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch
from tqdm import tqdm

from kernels.decode_inputs import LOC, ROWS, SEQ, TABLE, unpack_decode_inputs
from shared.models.forward_batch import ForwardBatch, ForwardMode
from shared.gc_freeze import collections_paused
from shared.knobs import knob

log = logging.getLogger(__name__)


CASCADE_MIN_BS = knob("CASCADE_MIN_BS")  # smaller batches rarely share enough prefix to pay (and run eagerly if they do)


def capture_graph(forward, stream: torch.cuda.Stream, pool) -> torch.cuda.CUDAGraph:
    """forward() run twice on `stream` (compiles, autotuning and lazy allocations stay out of the graph),
    then captured into a graph drawing on the memory pool `pool` (None: a new one). No automatic garbage
    collection runs during the capture (shared/gc_freeze.py says why); callers capturing many graphs pause
    it, after one collection, around the whole loop."""
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with collections_paused(), torch.cuda.graph(g, pool=pool, stream=stream):
        forward()
    return g


def capture_graphs(keys: list, forward, device: torch.device, pool, desc: str, progress: bool, out_of_memory):
    """forward(key) captured for each key, in the order given (largest first, so that the later graphs reuse the
    memory pool the first reserved), on one side stream and the pool `pool` (None: the first graph's), with
    automatic collection paused for the whole loop after one collection. out_of_memory(key): the message of the
    RuntimeError a capture that runs out of GPU memory raises. The bar goes to stderr (the launcher relays it,
    prefixed with the worker's name). Returns ({key: graph}, the pool)."""
    stream = torch.cuda.Stream(device)
    graphs = {}
    with collections_paused(collect_first=True):
        for key in tqdm(keys, desc=desc, unit="graph", disable=not progress, dynamic_ncols=True):
            try:
                g = capture_graph(lambda: forward(key), stream, pool)
            except torch.OutOfMemoryError as e:
                raise RuntimeError(out_of_memory(key)) from e
            if pool is None:
                pool = g.pool()
            graphs[key] = g
    torch.cuda.synchronize(device)
    return graphs, pool


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 1025, 16))
    return [s for s in sizes if s <= max_bs] or [1]


class CudaGraphRunner:
    def __init__(self, model, kv_pool, req_to_token: torch.Tensor, token_buf: torch.Tensor, attn_backend,
                 max_bs: int, device: torch.device, progress: bool = True):
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.token_buf = token_buf  # the last sample of each request row: the next step's input
        self.attn_backend = attn_backend
        self.device = device
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        n = self.max_bs
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.req_pool_indices = torch.zeros(n, **i64)
        self.seq_lens = torch.ones(n, **i32)
        self.prefix_lens = torch.zeros(n, **i32)
        self.ones = torch.ones(n, **i32)
        self.start_loc = torch.arange(n, **i32)
        self.out_cache_loc = torch.zeros(n, **i64)
        # The step's inputs as the host copies them in ([n, 4] row-major: a batch of size bs reads the
        # first bs rows), all padding rows until the first run.
        self.staged = torch.zeros(n, 4, **i64)
        self.staged[:, SEQ] = 1
        # One logits buffer every graph writes its rows into: per-graph outputs would each hold their own
        # [bs, vocab] tensor for the runner's life (~9 GB in bf16 over the sizes to 1,024 with the
        # shared-prefix variants). Sharing is safe because replays run in stream order and each step's
        # sampling is enqueued before the next step launches (shared/engine/engine_loop.py, step). In the
        # lm_head's own dtype: the GEMM writes it directly and the sampler widens only what needs fp32.
        self.logits = torch.empty(n, model.config.vocab_size, dtype=model.logits_dtype, device=device)
        # (batch size, shared-prefix variant) -> graph
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self._capture_all(progress)

    def _batch(self, bs: int, cascade: bool = False) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
            positions=self.positions[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], extend_prefix_lens=self.prefix_lens[:bs],
            extend_seq_lens=self.ones[:bs], extend_start_loc=self.start_loc[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_to_token=self.req_to_token, kv_pool=self.kv_pool,
            attn_backend=self.attn_backend, graph_cascade=cascade)

    def _forward(self, bs: int, cascade: bool = False) -> torch.Tensor:
        unpack_decode_inputs(self.staged[:bs], self.token_buf, self.req_to_token, self.input_ids[:bs],
                             self.positions[:bs], self.req_pool_indices[:bs], self.out_cache_loc[:bs],
                             self.seq_lens[:bs], self.prefix_lens[:bs])
        fb = self._batch(bs, cascade)
        self.attn_backend.init_forward_metadata(fb)
        return self.model.forward_logits(fb, out=self.logits[:bs])

    def _capture_all(self, progress: bool) -> None:
        t0 = time.monotonic()
        cascade = self.attn_backend.graph_cascade()
        keys = [(bs, c) for bs in reversed(self.sizes) for c in ((False, True) if cascade and bs >= CASCADE_MIN_BS
                                                                  else (False,))]
        graphs, self.pool = capture_graphs(
            keys, lambda key: self._forward(*key), self.device, self.pool, "Capturing CUDA graphs", progress,
            lambda key: f"out of GPU memory capturing the decode CUDA graph of batch size {key[0]}"
                        f"{' (shared-prefix variant)' if key[1] else ''} beside the KV pool; lower --cuda-graph-max-bs "
                        f"(now {self.max_bs}) or --mem-fraction-static, or pass --disable-cuda-graph")
        self.graphs.update(graphs)
        log.debug("captured %d decode graphs in %.1fs", len(keys), time.monotonic() - t0)

    def can_run(self, bs: int) -> bool:
        return bs <= self.max_bs

    def _bucket(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def plan_cascade(self, groups: list, req_rows: list[int]):
        """A decode batch's prefix groups laid out for the shared-prefix graph of its bucket, or None when
        there is none or they do not fit it (the batch then runs eagerly)."""
        n = len(req_rows)
        if not self.can_run(n) or (self._bucket(n), True) not in self.graphs:
            return None
        return self.attn_backend.plan_graph_cascade(self._bucket(n), groups, req_rows, n)

    def load_cascade(self, plan, num_reqs: int) -> None:
        """Stage a plan_cascade result (made here, or on tensor-parallel rank 0) for the next run."""
        self.attn_backend.load_graph_cascade(self._bucket(num_reqs), plan, num_reqs)

    def run(self, rows: list[int], seq_lens: list[int], out_cache_loc: torch.Tensor, table: list[int],
            cascade: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of n = len(rows) requests: their slot-table rows, context lengths after the
        step, new KV slots (host int64) and slot-table entries (written at row, length - 1). Returns
        (logits [n, vocab], the rows on the device [n]); both are static buffers, valid until the next
        run. cascade: the shared-prefix graph, its groups staged by load_cascade."""
        n = len(rows)
        bs = self._bucket(n)
        pad = bs - n
        host = torch.empty(bs, 4, dtype=torch.int64)
        host[:n, ROWS] = torch.tensor(rows, dtype=torch.int64)
        host[:n, SEQ] = torch.tensor(seq_lens, dtype=torch.int64)
        host[:n, LOC] = out_cache_loc
        host[:n, TABLE] = torch.tensor(table, dtype=torch.int64)
        if pad:
            host[n:] = torch.tensor([0, 1, 0, 0], dtype=torch.int64)
        self.staged[:bs].copy_(host.pin_memory(), non_blocking=True)
        self.attn_backend.before_graph_replay(bs, seq_lens + [1] * pad)
        self.graphs[bs, cascade].replay()
        return self.logits[:n], self.req_pool_indices[:n]

    def neutralize(self, bs: int) -> None:
        """Make a bare replay of the graph of size bs harmless (benchmarks time replays of the last
        step): its rows then write their new K/V to the padding slot and leave the slot table as it is."""
        st = self.staged[:bs]
        st[:, TABLE] = self.req_to_token[st[:, ROWS], st[:, SEQ] - 1].to(torch.int64)
        st[:, LOC] = 0
