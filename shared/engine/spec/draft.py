"""STANDALONE speculation: a small draft model of the target's tokenizer proposes each request's next tokens
greedily, from its own KV pool (as many tokens as the target's) and request table, in its own ModelRunner
(CUDA graphs for its decode steps where the target has them).

A round, for the requests that draft: one extend pass over what each lacks in the draft's KV (the prompt the
first time, then the tokens the target confirmed since: its last sample and any draft not fed), which
samples the first draft, then k - 1 decode passes, each reading the previous draft on the device; the host
waits once, for all k. A constrained request drafts under its grammar: its matcher masks each pass's
sampling (the runner's grammar masks, as for the target) and takes each draft, rolled back after the round; a
round with grammars waits once a pass instead, filling the next mask while that pass's forward runs. Those
masks go to the engine with the drafts (`filled_masks`): verification samples under the same ones, and
filling them again would double the host's grammar work of a round. After
verification the draft's KV past what the target kept is dropped. The draft's KV only shapes proposals:
the target checks every one, so a stale draft costs acceptance, never output.

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
from shared.models.forward_batch import ForwardMode
from shared.engine.request import Req
from shared.engine.schedule_batch import ScheduleBatch
from shared.engine.spec import SpecConfigError, Speculator
from shared.models.parallel import unsharded
from shared.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1 << 30)


class _DraftRow:
    """One request's place in the draft's pool: a shadow request the draft runner schedules, the tokens
    whose KV it holds (host mirror), the drafts fed in the last round (positions past the confirmed), and
    the grammar masks its drafts of the last round were sampled under (constrained: handed to verification)."""

    __slots__ = ("shadow", "ids", "fed", "masks")

    def __init__(self, rid: str, row: int):
        self.shadow = Req(rid=rid, input_ids=[], params=_GREEDY, seed=0)
        self.shadow.req_pool_idx = row
        self.ids: list[int] = []
        self.fed = 0
        self.masks: list | None = None


_NO_DRAFTS = "no drafts"  # spec_state of a request the draft model cannot read: it decodes without drafts


def draft_graph_bs(config: EngineConfig) -> int:
    """The draft's largest decode graph: no running batch above --speculative-disable-batch-size drafts, so graphs
    past it would only cost start-up time and memory (a larger batch, were there one, runs eagerly)."""
    limit = config.speculative_disable_batch_size
    return min(config.cuda_graph_max_bs, limit) if limit > 0 else config.cuda_graph_max_bs


def draft_config(config: EngineConfig, target) -> EngineConfig:
    """The draft runner's config: the target's device, dtype and graphs, its pool sized as the target's."""
    return dataclasses.replace(
        config, model_path=config.speculative_draft_model_path, load_format="auto", quantization="none",
        max_total_tokens=target.max_total_tokens, max_context_len=target.max_context_len, page_size=1,
        kv_cache_dtype="auto", tp_size=1, enable_mixed_chunk=False, disable_shared_prefix_attention=True,
        cuda_graph_max_bs=draft_graph_bs(config), speculative_algorithm=None, speculative_draft_model_path=None)


def draft_memory(config: EngineConfig, sizes, context_len: int, act_bytes: int) -> tuple[int, int]:
    """What the draft runner will take of the GPU, for the target to leave free when it sizes its KV pool (the draft
    is built after it, with a pool of as many tokens: draft_config): (the draft's KV bytes a pool token, the rest:
    its weights in the model dtype and sizing.reserve_bytes of its shape at the target's sizes, filled `config`)."""
    from shared.engine import sizing
    from shared.models.loader import load_config_of

    mc = load_config_of(config.speculative_draft_model_path)
    per_token = 2 * mc.num_hidden_layers * mc.kv_size * act_bytes
    shape = sizing.ModelShape(min(context_len, mc.context_length), mc.vocab_size, mc.hidden_size, mc.intermediate_size,
                              act_bytes)
    sizes = dataclasses.replace(sizes, cuda_graph_max_bs=draft_graph_bs(config))
    return per_token, mc.num_params * act_bytes + sizing.reserve_bytes(sizes, shape)


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
        # Same tokenizer, but the embedding rows past it (padding) may differ in number: Qwen2.5's 0.5B pads
        # to 151936, its 7B to 152064. Drafts are sampled within the tokenizer's ids, which both must hold.
        if self.runner.vocab_size < target.tokenizer_vocab_size:
            raise SpecConfigError(f"the draft model's vocabulary ({self.runner.vocab_size}) does not cover the "
                                  f"tokenizer's {target.tokenizer_vocab_size} ids")
        self.runner.eos_token_ids = []
        self.runner.tokenizer_vocab_size = target.tokenizer_vocab_size
        self.allocator = SlotAllocator(self.runner.kv_pool.num_pages, 1, device="cpu")

    # ------------------------------------------------------------------ rows
    def _row(self, req: Req) -> _DraftRow | None:
        st = req.spec_state
        if st is None:
            if max(req.input_ids) >= self.runner.vocab_size:  # a prompt id only the target's padding has
                req.spec_state = _NO_DRAFTS
                return None
            row = self.runner.req_pool.alloc()
            if row is None:
                return None
            st = req.spec_state = _DraftRow(req.rid, row)
        return st if st is not _NO_DRAFTS else None

    def _truncate(self, st: _DraftRow, n: int) -> None:
        slots = st.shadow.slots
        if len(slots) > n:
            self.allocator.free(np.asarray(slots[n:], dtype=np.int64))
            del slots[n:]
            del st.ids[n:]
        st.shadow.kv_len = min(st.shadow.kv_len, n)

    def release(self, req: Req) -> None:
        st = req.spec_state
        if isinstance(st, _DraftRow):
            self._truncate(st, 0)
            self.runner.req_pool.free(st.shadow.req_pool_idx)
        req.spec_state = None

    def verified(self, req: Req, kept: int) -> None:
        """Fed drafts past the kept ones leave the draft's KV (the confirmed tokens end before them)."""
        st = req.spec_state
        if isinstance(st, _DraftRow) and st.fed:
            confirmed = len(req.input_ids) + req.num_resolved
            self._truncate(st, confirmed + min(kept, st.fed))
            st.fed = 0

    # ------------------------------------------------------------------ a round
    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        rows, news, ks, which = [], [], [], []
        for m, (req, k) in enumerate(zip(reqs, budgets)):
            confirmed = len(req.input_ids) + req.num_resolved
            # The round's KV, through its last fed draft, within the draft model's own context (it may be
            # shorter than the target's): past it the request decodes on without drafts.
            k = min(k, self.runner.max_context_len + 1 - confirmed)
            if k <= 0:
                self.release(req)
                continue
            st = self._row(req)
            if st is None:
                continue
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
            st.fed, st.masks = 0, None
            rows.append(st)
            news.append(self._tokens(req, keep, confirmed))
            ks.append(k)
            which.append(m)
        if not rows:
            return drafts
        need = [len(x) + k - 1 for x, k in zip(news, ks)]
        slots = self.allocator.alloc(sum(need))
        if slots is None:
            # The draft's pool cannot hold the round (it shares no prefixes: requests of one long prompt fill
            # it far sooner than the target's): the rows that fit draft, the others not this round.
            parts = [self.allocator.alloc(n) for n in need]
            fit = [r for r, part in enumerate(parts) if part is not None]
            if not fit:
                return drafts
            rows, news, ks, which = ([xs[r] for r in fit] for xs in (rows, news, ks, which))
            slots = torch.cat([parts[r] for r in fit])
        # Constrained requests draft under their grammar: the shadow row carries the request's matcher, so the
        # draft runner masks its sampling as the target's does, and the matcher takes each draft (rolled back
        # after the round, leaving it exactly as it was).
        grammars = [req.grammar if req.grammar is not None and not req.grammar.failed
                    and not req.grammar.is_terminated() else None for req in (reqs[m] for m in which)]
        constrained = any(g is not None for g in grammars)
        taken = [0] * len(rows)
        masks: list[list] = [[] for _ in rows]
        for st, g in zip(rows, grammars):
            st.shadow.grammar = g
        try:
            raw, keep = self._run_round(rows, news, ks, slots.tolist(), grammars if constrained else None, taken,
                                        masks)
        finally:
            for st, g, n in zip(rows, grammars, taken):
                st.shadow.grammar = None
                if n:
                    g.rollback(n)
        for r, (st, m) in enumerate(zip(rows, which)):
            st.ids.extend(raw[r][:st.fed])  # the fed drafts' KV
            drafts[m] = raw[r][:keep[r]]
            st.masks = masks[r][:keep[r]] or None
        return drafts

    def filled_masks(self, req: Req) -> list | None:
        st = req.spec_state
        if not isinstance(st, _DraftRow):
            return None
        masks, st.masks = st.masks, None
        return masks

    def _run_round(self, rows: list[_DraftRow], news: list[list[int]], ks: list[int], slots: list[int],
                   grammars: list | None, taken: list[int], masks: list[list]) -> tuple[list[list[int]], list[int]]:
        """The round's passes. Returns each row's drafts as sampled and how many of them to propose (fewer
        than asked where the grammar ended or refused); a constrained row's host mask rows, one a draft, go to
        `masks`. Unconstrained (`grammars` None), the host waits once,
        for all passes; constrained, once a pass: pass s's mask needs the draft of pass s - 1 taken by the
        matcher, which is done while the device runs pass s's forward (its sampling waits for the mask)."""
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
        members = [list(range(len(rows)))]  # the rows of each pass, in order
        for st, new in zip(rows, news):
            st.shadow.kv_len += len(new)
            st.ids.extend(new)
        keep = list(ks)
        outs: list = []

        def settle() -> None:  # the next pass's results; the matchers take their drafts
            p = len(outs)
            out = handles[p].resolve()
            outs.append(out)
            mask = handles[p].grammar_mask
            filled = set(mask.rows) if mask is not None else ()
            for i, r in enumerate(members[p]):
                g = grammars[r] if grammars is not None else None
                if g is None or keep[r] <= p:
                    continue
                if i in filled and len(masks[r]) == p:  # the mask draft p was sampled under
                    masks[r].append(mask.host_bitmask[i])
                if not g.try_accept(out.next_token_ids[i]):
                    keep[r] = p  # unreachable under the mask; a refused draft is never proposed
                    continue
                taken[r] += 1
                if g.is_terminated():
                    keep[r] = p + 1  # nothing follows a stop token

        if handles[0].needs_sampling:
            self.runner.sample_pending(handles[0])  # the matchers stand at the first draft
        # k - 1 decode passes, each fed the previous draft on the device (token_buf).
        for step in range(1, max(ks)):
            live = [r for r in range(len(rows)) if keep[r] > step]
            if not live:
                break
            locs = slots[used:used + len(live)]
            used += len(live)
            for r, s in zip(live, locs):
                rows[r].shadow.slots.append(s)
            batch = ScheduleBatch(ForwardMode.DECODE, [rows[r].shadow for r in live],
                                  [rows[r].shadow.kv_len for r in live], [1] * len(live), [True] * len(live),
                                  [0] * len(live), torch.tensor(locs, dtype=torch.int64))
            handles.append(self.runner.launch(batch))
            members.append(live)
            for r in live:
                rows[r].shadow.kv_len += 1
                rows[r].fed += 1
            if handles[-1].needs_sampling:
                settle()  # the previous pass's drafts, taken by the matchers: this pass's masks
                self.runner.sample_pending(handles[-1])
        if used < len(slots):
            self.allocator.free(np.asarray(slots[used:], dtype=np.int64))
        while len(outs) < len(handles):  # unconstrained: the one wait of the round
            settle()
        raw: list[list[int]] = [[] for _ in rows]
        for out, mem in zip(outs, members):
            for i, r in enumerate(mem):
                raw[r].append(out.next_token_ids[i])
        return raw, keep

    @staticmethod
    def _tokens(req: Req, a: int, b: int) -> list[int]:
        """req's tokens [a, b) of prompt + output, without building the whole list."""
        n = len(req.input_ids)
        if b <= n:
            return req.input_ids[a:b]
        if a >= n:
            return req.output_ids[a - n:b - n]
        return req.input_ids[a:] + req.output_ids[:b - n]

    def info(self) -> dict:
        # The draft's own pool, empty when no request runs (a leak shows here, not in the target's kv_usage).
        total = self.allocator.total_size()
        return {**super().info(), "draft_kv_usage": round(1.0 - self.allocator.available_size() / total, 6),
                "draft_rows": self.runner.req_pool.max_reqs - self.runner.req_pool.available()}

    def close(self) -> None:
        self.runner.close()
