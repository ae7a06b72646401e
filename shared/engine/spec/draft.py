"""STANDALONE speculation: a small draft model of the target's tokenizer proposes each request's next tokens
greedily, from its own KV pool (as many tokens as the target's) and request table, in its own ModelRunner
(CUDA graphs for its decode steps where the target has them).

A round, for the requests that draft: one extend pass over what each lacks in the draft's KV (the prompt the
first time, then the tokens the target confirmed since: its last sample and any draft not fed), which
samples the first draft, then k - 1 decode passes, each reading the previous draft on the device; the host
waits once, for all k. After verification the draft's KV past what the target kept is dropped. The draft's
KV only shapes proposals: the target checks every one, so a stale draft costs acceptance, never output.

Under tensor parallelism the draft is rank 0's alone: a single-rank runner on rank 0's device, built inside
`unsharded()`, so it holds whole weights and no ranks of its own (its layers take their shards when built and
run collectives only where they hold one: none). The followers never see it: its drafts reach them as the
proposals of the verification pass rank 0 sends them, as NGRAM's do, and a rejected draft's correction of the
next input goes with `set_last_token`."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from shared.cache.allocator import SlotAllocator
from shared.engine.config import EngineConfig
from shared.engine.forward_batch import ForwardMode
from shared.engine.request import Req
from shared.engine.schedule_batch import ScheduleBatch
from shared.engine.spec import SpecConfigError, Speculator
from shared.models.parallel import unsharded
from shared.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1 << 30)


class _DraftRow:
    """One request's place in the draft's pool: a shadow request the draft runner schedules, the tokens
    whose KV it holds (host mirror), and the drafts fed in the last round (positions past the confirmed)."""

    __slots__ = ("shadow", "ids", "fed")

    def __init__(self, rid: str, row: int):
        self.shadow = Req(rid=rid, input_ids=[], params=_GREEDY, seed=0)
        self.shadow.req_pool_idx = row
        self.ids: list[int] = []
        self.fed = 0


def draft_config(config: EngineConfig, target) -> EngineConfig:
    """The draft runner's config: the target's device, dtype and graphs, its pool sized as the target's."""
    return dataclasses.replace(
        config, model_path=config.speculative_draft_model_path, load_format="auto", quantization="none",
        max_total_tokens=target.max_total_tokens, max_context_len=target.max_context_len, page_size=1,
        kv_cache_dtype="auto", tp_size=1, enable_mixed_chunk=False, disable_shared_prefix_attention=True,
        speculative_algorithm=None, speculative_draft_model_path=None)


class DraftModelSpeculator(Speculator):
    algorithm = "STANDALONE"

    def __init__(self, config: EngineConfig, target, tokenizer):
        super().__init__(config)
        from shared.engine.model_runner import ModelRunner
        from shared.tokenizer import Tokenizer

        path = config.speculative_draft_model_path
        try:
            draft_tok = Tokenizer.load(path)
        except Exception as e:
            raise SpecConfigError(f"--speculative-draft-model-path {path!r}: cannot load its tokenizer ({e})") from None
        if draft_tok.raw.get_vocab(with_added_tokens=True) != tokenizer.raw.get_vocab(with_added_tokens=True):
            raise SpecConfigError(f"the draft model {path!r} has a different tokenizer from the target's: "
                                  "speculation needs the same token ids on both")
        with unsharded():
            self.runner = ModelRunner(draft_config(config, target))
        if self.runner.vocab_size != target.vocab_size:
            raise SpecConfigError(f"the draft model's vocabulary ({self.runner.vocab_size}) differs from the "
                                  f"target's ({target.vocab_size})")
        self.runner.eos_token_ids = []
        self.runner.tokenizer_vocab_size = target.tokenizer_vocab_size
        self.allocator = SlotAllocator(self.runner.kv_pool.num_pages, 1, device="cpu")

    # ------------------------------------------------------------------ rows
    def _row(self, req: Req) -> _DraftRow | None:
        st = req.spec_state
        if st is None:
            row = self.runner.req_pool.alloc()
            if row is None:
                return None
            st = req.spec_state = _DraftRow(req.rid, row)
        return st

    def _truncate(self, st: _DraftRow, n: int) -> None:
        slots = st.shadow.slots
        if len(slots) > n:
            self.allocator.free(np.asarray(slots[n:], dtype=np.int64))
            del slots[n:]
            del st.ids[n:]
        st.shadow.kv_len = min(st.shadow.kv_len, n)

    def release(self, req: Req) -> None:
        st = req.spec_state
        if st is not None:
            self._truncate(st, 0)
            self.runner.req_pool.free(st.shadow.req_pool_idx)
        req.spec_state = None

    def verified(self, req: Req, kept: int) -> None:
        """Fed drafts past the kept ones leave the draft's KV (the confirmed tokens end before them)."""
        st = req.spec_state
        if st is not None and st.fed:
            confirmed = len(req.input_ids) + req.num_resolved
            self._truncate(st, confirmed + min(kept, st.fed))
            st.fed = 0

    # ------------------------------------------------------------------ a round
    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        rows, news, ks, which = [], [], [], []
        for m, (req, k) in enumerate(zip(reqs, budgets)):
            st = self._row(req)
            if st is None:
                continue
            confirmed = len(req.input_ids) + req.num_resolved
            ids = st.ids
            # Drafts fed last round and never verified (dropped), or a rewritten last token: drop the KV that
            # no longer matches the confirmed tokens (only the tail can differ).
            n = min(len(ids), confirmed - 1)
            start = max(0, n - 4)
            tail = self._tokens(req, start, n)
            keep = start
            while keep < n and ids[keep] == tail[keep - start]:
                keep += 1
            self._truncate(st, keep)
            st.fed = 0
            rows.append(st)
            news.append(self._tokens(req, keep, confirmed))
            ks.append(k)
            which.append(m)
        if not rows:
            return drafts
        slots = self.allocator.alloc(sum(map(len, news)) + sum(k - 1 for k in ks))
        if slots is None:  # the draft's pool is full: no drafts this round
            return drafts
        slots = slots.tolist()
        used = 0
        for st, new in zip(rows, news):
            st.shadow.slots.extend(slots[used:used + len(new)])
            used += len(new)
        # One extend pass: what each lacks, sampling its first draft.
        prefix = [st.shadow.kv_len for st in rows]
        batch = ScheduleBatch(ForwardMode.EXTEND, [st.shadow for st in rows], prefix, [len(x) for x in news],
                              [True] * len(rows), [t for x in news for t in x],
                              torch.tensor(slots[:used], dtype=torch.int64))
        handles = [self.runner.launch(batch)]
        for st, new in zip(rows, news):
            st.shadow.kv_len += len(new)
            st.ids.extend(new)
        # k - 1 decode passes, each fed the previous draft on the device (token_buf).
        for step in range(1, max(ks)):
            live = [st for st, k in zip(rows, ks) if k > step]
            locs = slots[used:used + len(live)]
            used += len(live)
            for st, s in zip(live, locs):
                st.shadow.slots.append(s)
            batch = ScheduleBatch(ForwardMode.DECODE, [st.shadow for st in live], [st.shadow.kv_len for st in live],
                                  [1] * len(live), [True] * len(live), [0] * len(live),
                                  torch.tensor(locs, dtype=torch.int64))
            handles.append(self.runner.launch(batch))
            for st in live:
                st.shadow.kv_len += 1
                st.fed += 1
        if used < len(slots):
            self.allocator.free(np.asarray(slots[used:], dtype=np.int64))
        outs = [h.resolve() for h in handles]  # the one wait of the round
        for r, m in enumerate(which):
            drafts[m].append(outs[0].next_token_ids[r])
        for step in range(1, len(outs)):  # pass `step` holds the rows still drafting, in order
            live = [m for m, k in zip(which, ks) if k > step]
            for r, m in enumerate(live):
                drafts[m].append(outs[step].next_token_ids[r])
        for st, m in zip(rows, which):
            st.ids.extend(drafts[m][:st.fed])  # the fed drafts' KV
        return drafts

    @staticmethod
    def _tokens(req: Req, a: int, b: int) -> list[int]:
        """req's tokens [a, b) of prompt + output, without building the whole list."""
        n = len(req.input_ids)
        if b <= n:
            return req.input_ids[a:b]
        if a >= n:
            return req.output_ids[a - n:b - n]
        return req.input_ids[a:] + req.output_ids[:b - n]

    def close(self) -> None:
        self.runner.close()
