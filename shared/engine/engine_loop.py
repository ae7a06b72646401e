"""The engine loop (SGLang's scheduler loop): schedule -> run -> postprocess, on its own thread; what
each step runs is the scheduling policy's choice (shared/engine/schedule_policy.py).

The worker's event loop hands requests in through a thread-safe inbox and receives TokenOutput batches
through a callback; the model never runs on the event loop.
"""
from __future__ import annotations

import logging
import queue
import random
import threading
import time

import torch
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from shared.cache.allocator import SlotAllocator
from shared.cache.no_cache import NoPrefixCache
from shared.cache.radix_cache import RadixCache
from shared.constrained import RetokenizeMemo, apply_jump, forced_text, jump_forward, plan_jump, set_allowed
from shared.engine.config import EngineConfig
from shared.engine.detokenizer import Detokenizer
from shared.models.forward_batch import ForwardMode
from shared.engine.model_runner import ModelRunner, StepOutput
from shared.engine.penalties import penalized
from shared.engine.request import PENDING_TOKEN, Req, ReqStatus
from shared.engine.schedule_batch import ScheduleBatch
from shared.engine.schedule_policy import SchedulePolicy
from shared.engine.spec import build_speculator
from shared import limits
from shared.errors import InvalidRequest, Overloaded
from shared.pd.sides import DecodeSide, PrefillSide, transfer_budget, validate_transfer
from shared.protocol import (FinishAbort, FinishLength, FinishReason, FinishStop, GenerateRequest, KvDone,
                             TokenOutput)
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class _Abort:
    rid: str


@dataclass
class _Call:
    fn: Callable
    future: Future


@dataclass
class _KvArrived:
    transfer_id: str
    done: KvDone
    buf: torch.Tensor
    at: float


@dataclass
class _KvOffered:
    transfer_id: str


@dataclass
class _KvFailed:
    transfer_id: str
    reason: str


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer,
                 on_output: Callable[[list[TokenOutput]], None], runner: ModelRunner | None = None):
        """`runner` lets a benchmark reuse loaded weights and KV memory for several engine variants
        (only one may be active at a time: they share the pool). The sizes config leaves unset (running
        requests, graph batch, prefill chunk) are the runner's, derived from its pool and GPU."""
        self.tokenizer = tokenizer
        self.on_output = on_output
        self._owns_runner = runner is None
        self.runner = runner or ModelRunner(config)
        self.config = config = self.runner.sized(config)
        model_eos = getattr(self.runner.model_config, "eos_token_ids", None) or []
        self.eos_token_ids = sorted(set(tokenizer.eos_token_ids) | set(model_eos))
        self.runner.eos_token_ids = self.eos_token_ids
        self.runner.tokenizer_vocab_size = min(tokenizer.vocab_size, self.runner.vocab_size)
        self.allocator = SlotAllocator(self.runner.kv_pool.num_pages, config.page_size, device="cpu")
        if config.enable_hierarchical_cache:
            from shared.engine.sizing import tiered_cache

            try:
                self.cache = tiered_cache(config, self.allocator, self.runner)
            except BaseException:
                if self._owns_runner:
                    self.runner.close()  # the other tensor-parallel ranks, if any
                raise
        else:
            cache_cls = NoPrefixCache if config.disable_radix_cache else RadixCache
            self.cache = cache_cls(self.allocator, config.page_size)
        # PD mode: the prefill/decode halves (shared/pd/sides.py), wired by the worker's transfer
        # glue; idle in unified mode. The scheduler asks their stage queues about PD requests.
        # Each bounds the bytes of KV buffers its transfers hold outside the pool (--kv-transfer-max-bytes).
        self.prefill_side = PrefillSide(self, transfer_budget(config, self.runner))
        self.decode_side = DecodeSide(self, transfer_budget(config, self.runner))
        self.policy = SchedulePolicy(config, self.cache, self.allocator, self.runner.req_pool,
                                   self.runner.max_context_len, prefill_stages=self.prefill_side.stages,
                                   decode_stages=self.decode_side.stages)
        self.detok = Detokenizer(tokenizer)
        from shared.constrained import GrammarCache

        self.grammars = GrammarCache(tokenizer, self.runner.vocab_size,
                                     jump_forward=not config.disable_jump_forward)
        self._retokenized = RetokenizeMemo()  # jump boundaries' encodings (this engine's tokenizer)
        # Speculative decoding (shared/engine/spec/): None when off.
        self.spec = build_speculator(config, self.runner, tokenizer)
        self._grammar_wait: list[Req] = []  # admitted, waiting for their grammar to compile
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._reqs: dict[str, Req] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rng = random.Random(config.random_seed)
        self.steps = 0
        # Passes launched, by mode, and the tokens of the extend passes: how a workload was scheduled
        # (a trickle of arrivals shows as more, smaller extend passes and more decode passes).
        # "busy_s" / "busy_timed": wall seconds from each launch to the next while work kept coming, and
        # how many launches they cover; "decode_s" / "decode_timed": the same over runs of decode passes
        # only (the launch before and the one before that were decode too: with overlap a launch waits
        # on the pass two back, so only then is the interval one decode step). The engine's step time,
        # comparable between a served workload and the offline engine.
        self.passes = {"extend": 0, "decode": 0, "extend_tokens": 0,
                       "busy_s": 0.0, "busy_timed": 0, "decode_s": 0.0, "decode_timed": 0}
        # (when, its mode, the mode of the launch before) of the last pass launched
        self._last_launch: tuple[float, str, str] | None = None
        # The latest busy period on this host's monotonic clock (time.perf_counter, CLOCK_MONOTONIC: one
        # clock for every process on the machine): the first launch after the engine was idle and the end
        # of the last pass processed since that delivered tokens. A client on the same host sets its own
        # send and receive times against them: what a served run loses before the engine starts and after
        # it ends (the edges).
        # "count": busy periods begun (a served run that starved the engine midway shows more than one).
        self.busy_period = {"start": 0.0, "end": 0.0, "count": 0}
        self._was_idle = True
        self.generated_tokens = 0
        self._pending = None  # PendingStep launched but not yet processed
        # The step launched in this call of step() while the previous one is processed: a request
        # whose next input changes on the host then (jump-forward) leaves it (`_leave_launching`).
        self._launching = None
        # Fault isolation: batches launched and not yet processed, and the one being launched or
        # processed right now (the one a step's exception belongs to).
        self._inflight: list[ScheduleBatch] = []
        self._failing: ScheduleBatch | None = None
        self.failed_steps = 0
        self.jump_forward_tokens = 0
        self.jump_forward_declined = 0  # jumps not taken: too few forced tokens to pay for a catch-up pass
        self._jump_candidates: list[tuple[Req, int]] = []  # this step's grammar requests, for _settle_jumps
        # The last step whose grammar requests sampled made jumps (or verify-mode proposals): the next
        # likely does too, so the next constrained step is processed before scheduling (see step()).
        self._expect_jumps = False
        self.forced_mask_rows = 0  # verify mode: proposal positions masked from the forced text, no fill
        self._host_dependent = 0  # live requests whose sampling needs their tokens on the host

    # ------------------------------------------------------------------ thread-safe API
    def submit(self, msg: GenerateRequest) -> None:
        self.inbox.put(msg)

    def abort(self, rid: str) -> None:
        self.inbox.put(_Abort(rid))

    def kv_arrived(self, transfer_id: str, done: KvDone, buf: torch.Tensor) -> None:
        self.inbox.put(_KvArrived(transfer_id, done, buf, time.monotonic()))

    def kv_offered(self, transfer_id: str) -> None:
        """Decode side: the prefill worker has taken this request (its KV is committed there)."""
        self.inbox.put(_KvOffered(transfer_id))

    def kv_failed(self, transfer_id: str, reason: str) -> None:
        self.inbox.put(_KvFailed(transfer_id, reason))

    def call(self, fn: Callable) -> Future:
        """Run fn() on the engine thread between steps (flush, info)."""
        fut: Future = Future()
        self.inbox.put(_Call(fn, fut))
        return fut

    def is_idle(self) -> bool:
        """Nothing accepted is still in progress (used to drain before stopping)."""
        return self.policy.is_idle() and not self.prefill_side.busy and not self._grammar_wait

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run_forever, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.spec is not None:
            self.spec.close()
        if self._owns_runner:
            self.runner.close()  # the other tensor-parallel ranks, if any

    # ------------------------------------------------------------------ loop
    def run_forever(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)  # per thread: kernels launch on the current device
        while not self._stop.is_set():
            self.safe_step()

    def safe_step(self) -> bool:
        """One step; an exception in it ends the request at fault only (see `_recover`)."""
        try:
            return self.step()
        except Exception as e:
            log.exception("engine step failed")
            self._recover(e)
            return True

    def step(self) -> bool:
        """schedule -> launch -> process the previous step's results while this one runs.

        With overlap on, step N+1 is scheduled and launched before step N's tokens reach the host; the
        scheduler sees placeholders for them (decode inputs are read on the device). Requests whose
        next sampling depends on host state (penalties over their output) turn overlap off for the
        steps they are in. Grammars do not: a step with constrained requests launches its forward
        pass, then step N is processed (the grammars take its tokens), then the host fills step N+1's
        masks while the device runs its forward, and only then is N+1's sampling enqueued.

        Except while jump-forward is jumping: a request that jumps over forced text after step N's
        token cannot use its row of step N+1 (launched before that token was known): the row is
        dropped and its forced tokens wait for step N+2, so each forced run would cost the request two
        passes, and in lockstep batches every other pass would be wasted. So while the last processed
        step's tokens led to jumps (`_expect_jumps`), and after an extend pass (its requests' next
        token, after a prompt or a forced run, is mostly at a choice the grammar follows with forced
        text), a constrained step is processed as soon as its sampling is enqueued, before the next one
        is scheduled: the next pass extends the forced runs at once (its masks still fill while its
        forward runs)."""
        if self._pending is not None and (not self.config.enable_overlap or self._host_dependent > 0):
            self._resolve_pending()
        idle = self.policy.is_idle()
        if idle:
            # Out of work (a pending pass then only holds rows of requests that ended): the time until
            # the next launch is no pass's. A caller stepping until its requests end stops here.
            self._last_launch = None
            self._was_idle = True
        self._drain_inbox(block=idle and self._pending is None and not self._grammar_wait)
        self._poll_grammars()
        batch = self.policy.schedule()
        self._emit_failed()
        self.prefill_side.open_new()
        self.decode_side.announce()
        if batch is None:
            self._last_launch = None  # out of work: the gap until the next pass is no pass's time
            if self._pending is not None:
                self._resolve_pending()
                return True
            if not self.policy.is_idle() or self._grammar_wait:
                self._drain_inbox(block=True, timeout=0.005)
            return False
        self._failing = batch
        handle = self.runner.launch(batch)
        self._inflight.append(batch)
        self._on_launch(batch)
        self._failing = None
        self._launching = handle
        try:
            self._resolve_pending()
        finally:
            self._launching = None
        if handle.needs_sampling:
            self._failing = batch
            self.runner.sample_pending(handle)
            self._failing = None
        self._pending = handle
        self.steps += 1
        # The pass's computed KV enters the tree now, while the device runs it, where that leaves the same
        # tree as entering in the next schedule() (which, when this pass is processed first as below, runs
        # with the device idle). Its rows cannot leave it any more: only the previous pass's processing drops rows.
        self.policy.cache_extended_apart()
        if (not self.config.enable_overlap or self._host_dependent > 0 or handle.counts is not None
                or self._jumps_likely_after(handle) or self._speculating()):
            # A pass verifying proposals (jump-forward's verify mode, drafts) decides on the host where its
            # requests continue: nothing is scheduled after it until it is processed. So does a
            # constrained pass while jump-forward is jumping (above), and any pass while speculation is on
            # (its tokens are what the next drafts continue: a pass launched before them would be wasted).
            self._resolve_pending()
        return True

    def _speculating(self) -> bool:
        return self.spec is not None and self.spec.drafts_for(len(self.policy.running)) > 0

    def _jumps_likely_after(self, handle) -> bool:
        """Whether the tokens of this constrained pass will likely make jumps (see step())."""
        return (handle.constrained and not self.config.disable_jump_forward
                and (self._expect_jumps or handle.batch.mode == ForwardMode.EXTEND))

    def _resolve_pending(self) -> None:
        if self._pending is None:
            return
        handle, self._pending = self._pending, None
        self._failing = handle.batch
        self._process(handle.batch, handle.resolve(), handle.dropped)
        self._inflight.remove(handle.batch)
        self._failing = None

    def _drain_inbox(self, block: bool, timeout: float | None = None) -> None:
        try:
            item = self.inbox.get(block=block, timeout=timeout)
        except queue.Empty:
            return
        while True:
            if item is not None:
                self._handle(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item) -> None:
        if isinstance(item, GenerateRequest):
            try:
                self._admit(item)
            except Exception as e:  # a request nothing validated against: it alone ends
                log.exception("admitting %s failed", item.rid)
                req = self._reqs.get(item.rid)
                if req is not None:
                    self._fail_one(req, e)
                else:
                    self.on_output([TokenOutput(rid=item.rid, token_ids=[], text="", finished=True,
                                                finish_reason=FinishAbort(message="internal error"),
                                                error=f"internal error admitting the request ({type(e).__name__})")])
        elif isinstance(item, _Abort):
            self._abort(item.rid)
        elif isinstance(item, _KvArrived):
            self.decode_side.arrived(item.transfer_id, item.done, item.buf, item.at)
        elif isinstance(item, _KvOffered):
            self.decode_side.offered(item.transfer_id)
        elif isinstance(item, _KvFailed):
            self.decode_side.failed(item.transfer_id, item.reason)
        elif isinstance(item, _Call):
            try:
                item.future.set_result(item.fn())
            except Exception as e:
                item.future.set_exception(e)

    # ------------------------------------------------------------------ admission
    def validate(self, msg: GenerateRequest) -> SamplingParams:
        params = msg.sampling
        params.validate()  # the limits again (shared/limits.py): a frame may not have come through a gateway
        if not 0 < len(msg.rid) <= limits.MAX_RID_LEN:
            raise InvalidRequest(f"rid must have 1 to {limits.MAX_RID_LEN} characters", "rid")
        if not 0 <= msg.top_logprobs_num <= limits.MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs_num must be in [0, {limits.MAX_TOP_LOGPROBS}]", "top_logprobs_num")
        if msg.logprob_start_len < -1:
            raise InvalidRequest("logprob_start_len must be >= -1", "logprob_start_len")
        if params.n > limits.MAX_N:
            raise InvalidRequest(f"n must be <= {limits.MAX_N}", "n")
        n = len(msg.input_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty", "input_ids")
        vocab = self.runner.vocab_size
        if min(msg.input_ids) < 0 or max(msg.input_ids) >= vocab:  # builtins: C loops, not a genexpr
            raise InvalidRequest(f"input_ids must be in [0, {vocab})", "input_ids")
        if n >= self.runner.max_context_len:
            raise InvalidRequest(
                f"the prompt has {n} tokens; this model's context is {self.runner.max_context_len}",
                "input_ids", code="context_length_exceeded")
        if n + 1 > self.runner.max_total_tokens:
            raise InvalidRequest(f"the prompt ({n} tokens) does not fit the KV cache "
                                 f"({self.runner.max_total_tokens} tokens)", "input_ids")
        if msg.rid in self._reqs:
            raise InvalidRequest(f"duplicate request id {msg.rid}", "rid")
        validate_transfer(msg, self.prefill_side, self.decode_side)
        return params

    def _admit(self, msg: GenerateRequest) -> None:
        try:
            params = self.validate(msg)
        except InvalidRequest as e:
            self.on_output([TokenOutput(rid=msg.rid, token_ids=[], text="", finished=True,
                                        finish_reason=FinishAbort(message=e.message),
                                        error=e.message, refused=True)])
            return
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        req = Req(rid=msg.rid, input_ids=list(msg.input_ids), params=params, seed=seed,
                  return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
                  top_logprobs_num=msg.top_logprobs_num if msg.return_logprob else 0,
                  cache_salt=msg.cache_salt, stream=msg.stream, transfer=msg.transfer)
        req.detok = self.detok.new_state(params.stop, params.skip_special_tokens, params.no_stop_trim,
                                         prompt_tail=req.input_ids, stop_regex=params.stop_regex)
        self._reqs[req.rid] = req
        if penalized(params):
            self._host_dependent += 1
        if req.transfer_role == "decode":
            self.decode_side.on_admit(req)
        if params.grammar is not None:
            req.grammar_future = self.grammars.submit(*params.grammar)
            self._grammar_wait.append(req)
            return
        self.policy.add(req)

    def _poll_grammars(self) -> None:
        """Requests whose grammar finished compiling join the scheduler; a bad grammar ends its request,
        and so does one still compiling past the deadline (the compile is abandoned, see GrammarCache)."""
        if self._grammar_wait:
            deadline = self.grammars.default_timeout_s
            now = time.monotonic()
            for req in self._grammar_wait:
                if not req.grammar_future.done() and now - req.arrival_time > deadline:
                    self.grammars.abandon(*req.params.grammar, deadline)
        for req in [r for r in self._grammar_wait if r.grammar_future.done()]:
            self._grammar_wait.remove(req)
            if req.finished:
                continue
            exc = req.grammar_future.exception()
            if exc is not None:
                msg = getattr(exc, "message", None) or str(exc)
                busy = isinstance(exc, Overloaded)  # not the request's fault: the gateway's 503, not a 400
                self._finish(req, FinishAbort(message=msg), error=msg, refused=not busy, overloaded=busy)
                continue
            req.grammar = self.grammars.new_state(req.grammar_future.result())
            self.policy.add(req)

    def _abort(self, rid: str) -> None:
        req = self._reqs.get(rid)
        if req is None:
            return
        if req in self._grammar_wait:
            self._grammar_wait.remove(req)
        self._finish(req, FinishAbort(message="aborted by the client"))

    # ------------------------------------------------------------------ results
    def _on_launch(self, batch: ScheduleBatch) -> None:
        """What the host knows as soon as a step is enqueued: KV lengths and one pending token per
        sampling request (its value arrives with the step's results)."""
        passes, now = self.passes, time.perf_counter()
        mode = "decode" if batch.mode is ForwardMode.DECODE else "extend"
        last = self._last_launch
        if last is not None:
            passes["busy_s"] += now - last[0]
            passes["busy_timed"] += 1
            if mode == last[1] == last[2] == "decode":
                passes["decode_s"] += now - last[0]
                passes["decode_timed"] += 1
        passes[mode] += 1
        if mode == "extend":
            passes["extend_tokens"] += len(batch.input_ids)
        if self._was_idle:
            self._was_idle = False
            self.busy_period = {"start": now, "end": now, "count": self.busy_period["count"] + 1}
        self._last_launch = (now, mode, last[1] if last is not None else "")
        for i, req in enumerate(batch.reqs):
            req.kv_len += batch.extend_lens[i]
            if batch.sample[i] and req.params.max_new_tokens > 0:
                req.output_ids.append(PENDING_TOKEN)
        if self.prefill_side.on_kv_gathered is not None:
            self.prefill_side.on_launch(batch.reqs, batch.sample)

    def _process(self, batch: ScheduleBatch, out: StepOutput, dropped: set[int] = frozenset()) -> None:
        ready: list[Req] = []
        first_steps = self.decode_side.timing  # PD: requests whose first decode step is being timed
        for i, req in enumerate(batch.reqs):
            if req.finished or i in dropped:
                continue  # finished (or aborted, or left the step) while it was in flight: results moot
            if out.input_logprobs[i] is not None:
                req.input_logprobs.extend(out.input_logprobs[i])
                req.input_top_logprobs.extend(out.input_top_logprobs[i])
            if not batch.sample[i]:
                continue
            if req.transfer_role == "prefill":
                self.prefill_side.hand_off(req, out, i)
                continue
            if req.params.max_new_tokens == 0:
                req.finish_reason = FinishLength(length=0)
                if req.top_logprobs_num > 0:
                    # No token is sampled, but the next position's top-k is known (SGLang answers it:
                    # chain-of-thought decoding branches on it).
                    req.pending_output_top_logprobs.append(out.top_logprobs[i] or [])
                ready.append(req)
                continue
            accepted: list[int] = []
            if req.drafted:
                self._take_verified(req, out, i)
            else:
                if req.proposed:
                    tok, accepted = self._verify_proposals(req, out, i)
                else:
                    tok = out.next_token_ids[i]
                self._take_token(req, tok, accepted, out.logprobs[i], out.top_logprobs[i])
            if first_steps:
                self.decode_side.first_step_done(req)
            ready.append(req)
        self._settle_jumps()
        if self.spec is not None:
            self._draft(ready)
        if ready:  # a pass whose rows all ended before it was processed (overlap's last one) delivers nothing
            self.busy_period["end"] = time.perf_counter()  # before the outputs leave: a client sees them after
        self._emit(ready)

    def _take_token(self, req: Req, tok: int, accepted: list[int], logprob, top_logprobs) -> None:
        """A sampled token reached the host: record it, detokenize, advance the grammar, and decide whether
        the request is finished (a jump over forced text comes after the step's tokens: _settle_jumps)."""
        req.output_ids[req.num_resolved] = tok
        req.num_resolved += 1
        self.generated_tokens += 1
        if req.return_logprob:
            req.pending_output_logprobs.append([logprob, tok])
            req.pending_output_top_logprobs.append(top_logprobs or [])
        text, stop_hit = self.detok.add_tokens(req.detok, accepted + [tok])
        req.pending_text += text
        grammar_done = False
        if req.grammar is not None:
            if not req.grammar.accept_token(tok):
                req.finish_reason = FinishAbort(message="the sampled token violates the grammar")
                return
            grammar_done = req.grammar.is_terminated()
        self._check_finish(req, tok, stop_hit, grammar_done)
        if req.grammar is not None and req.finish_reason is None:
            self._jump_candidates.append((req, tok))  # jumped (or not) with the step's others: _settle_jumps

    def _check_finish(self, req: Req, tok: int, stop_hit: bool, grammar_done: bool) -> None:
        p = req.params
        n_out = req.num_resolved
        if grammar_done:
            req.finish_reason = FinishStop(matched=tok)
        elif (tok in p.stop_token_ids or (tok in self.eos_token_ids and not p.ignore_eos)) \
                and n_out >= p.min_new_tokens:
            req.finish_reason = FinishStop(matched=tok)
        elif stop_hit and req.detok.regex_error:
            req.finish_reason = FinishAbort(message=req.detok.regex_error)
        elif stop_hit:
            req.finish_reason = FinishStop(matched=req.detok.matched_stop)
        elif n_out >= p.max_new_tokens:
            req.finish_reason = FinishLength(length=p.max_new_tokens)
        elif len(req.input_ids) + n_out >= self.runner.max_context_len:
            req.finish_reason = FinishLength(length=n_out)

    def _emit(self, ready: list[Req]) -> None:
        outputs = []
        interval = self.config.stream_interval
        for req in ready:
            if req.finished:
                self._release(req)
                req.pending_text += self.detok.flush(req.detok)
                outputs.append(self._make_output(req))
            elif req.stream and (interval <= 1 or req.sent_token_count == 0
                                 or req.num_resolved - req.sent_token_count >= interval):
                outputs.append(self._make_output(req))
        if outputs:
            self.on_output(outputs)

    def _settle_jumps(self) -> None:
        """Jump the step's grammar requests over the text their grammars force (compressed FSM), all
        together or none: the next pass then extends the forced tokens (a catch-up pass, outside CUDA
        graphs, for the whole batch) instead of decoding one token per request. It pays when the forced
        tokens per running request reach `jump_forward_threshold` (about what a catch-up pass costs
        over a decode step, in decode steps), or when the next pass extends anyway (waiting or chunked
        prompts). Declined runs are decoded one by one, the mask forcing each token."""
        candidates, self._jump_candidates = self._jump_candidates, []
        # Only requests still running (a step that failed half-way may leave ended ones behind).
        candidates = [(req, tok) for req, tok in candidates if not req.finished]
        if not candidates or self.config.disable_jump_forward:
            return
        if self.config.jump_forward_mode == "verify":
            for req, _ in candidates:
                self._propose_forced(req)
            self._expect_jumps = any(req.proposed for req, _ in candidates)
            return
        jumps = []
        for req, tok in candidates:  # planned only: the matchers move for the jumps taken
            forced = forced_text(req.grammar)
            budget = req.params.max_new_tokens - req.num_resolved
            # The resolved tokens only: a trailing placeholder belongs to the step being launched.
            jf = plan_jump(req.grammar, req.output_ids[:req.num_resolved], self.tokenizer, max_retokenize=1,
                           budget=budget, forced=forced, memo=self._retokenized) if forced else None
            if jf is not None:
                jumps.append((req, tok, jf))
        extend_due = bool(self.policy.waiting) or self.policy.chunked is not None
        need = self.config.jump_forward_threshold * len(self.policy.running)
        if not extend_due and sum(len(jf.new_ids) - jf.rollback for _, _, jf in jumps) < need:
            self.jump_forward_declined += len(jumps)
            self._expect_jumps = False
            return
        # final: this mode never rolls a jump's tokens back (only verify mode's proposals are).
        jumps = [(req, tok, jf) for req, tok, jf in jumps
                 if apply_jump(req.grammar, jf, req.output_ids[:req.num_resolved], final=True)]
        self._expect_jumps = bool(jumps)
        for req, tok, jf in jumps:
            self._check_finish(req, tok, self._jump_forward(req, jf), False)

    def _jump_forward(self, req: Req, jf) -> bool:
        """Append the run of tokens the grammar forced, re-tokenized at the boundary. Only the just-sampled
        token may be rewritten (its KV exists only if the step launched meanwhile computed it: that row
        leaves the step, `_leave_launching`); the next step extends all new tokens in one pass. Returns
        whether a stop string appeared."""
        self._leave_launching(req)
        if jf.rollback:
            del req.output_ids[-jf.rollback:]
        req.output_ids.extend(jf.new_ids)
        if req.req_pool_idx is not None and req.seq_len - req.kv_len == 1:
            # The next input is now the run's last token, not the sample: a rollback with one new token
            # leaves a single token to compute, which a decode pass reads from the device buffer. (With
            # more, the next pass extends them from the host's ids and its sample refills the buffer.)
            self.runner.set_last_token(req.req_pool_idx, req.output_ids[-1])
        req.num_resolved = len(req.output_ids)
        req.sent_token_count = min(req.sent_token_count, req.num_resolved)
        self.jump_forward_tokens += len(jf.new_ids)
        text, stop_hit = self.detok.reset_output(req.detok, req.output_ids)
        req.pending_text += text
        if req.return_logprob:  # forced tokens have probability one under the grammar
            for t in jf.new_ids:
                req.pending_output_logprobs.append([0.0, t])
                req.pending_output_top_logprobs.append([])
        return stop_hit

    def _propose_forced(self, req: Req) -> bool:
        """Verify mode: append the forced run as proposals, with the allowed-token mask at each of
        their positions (recorded by replaying the matcher over them). The next pass extends them and
        samples at every position; `_verify_proposals` keeps the prefix the model agrees with. A request
        retracted to the queue meanwhile (overlap) proposes nothing: it decodes on when readmitted."""
        if req.status is not ReqStatus.RUNNING:
            return False
        budget = req.params.max_new_tokens - req.num_resolved - 1  # room for the sample after them
        jf = jump_forward(req.grammar, req.output_ids[:req.num_resolved], self.tokenizer, max_retokenize=0,
                          budget=budget, memo=self._retokenized)
        if jf is None or not jf.new_ids:
            return False
        self._leave_launching(req)
        k = len(jf.new_ids)
        req.grammar.rollback(k)
        req.proposal_masks = self._forced_run_masks(req.grammar, jf)
        req.output_ids.extend(jf.new_ids)
        req.proposed = k
        return False

    def _forced_run_masks(self, grammar, jf) -> torch.Tensor:
        """Allowed tokens at each proposal position and after the last, replaying the matcher over
        the proposals (it ends after them). Inside the forced run the allowed tokens are those that
        spell a prefix of the forced text still ahead (VocabIndex.prefix_tokens): those rows need no
        fill by the matcher, only the positions where the grammar's choice is open do (where a token
        may run past the forced text, or the grammar could end)."""
        k = len(jf.new_ids)
        masks = torch.full((k + 1, (self.runner.vocab_size + 31) // 32), -1, dtype=torch.int32)
        ahead = jf.forced_text.encode()
        vocab = grammar.vocab
        for m, t in enumerate(jf.new_ids):
            allowed = None
            if ahead.startswith(vocab.token_bytes[t]) and not grammar.is_completed():
                allowed = vocab.prefix_tokens(ahead)
            if allowed is None:
                grammar.fill_bitmask(masks, m)
            else:
                set_allowed(masks, m, allowed)
                self.forced_mask_rows += 1
            accepted = grammar.accept_token(t)
            assert accepted, "a forced token the grammar just produced must be accepted"
            ahead = ahead[len(vocab.token_bytes[t]):] if ahead.startswith(vocab.token_bytes[t]) else b""
        grammar.fill_bitmask(masks, k)
        return masks

    def _verify_proposals(self, req: Req, out: StepOutput, i: int) -> tuple[int, list[int]]:
        """Keep the proposals the model sampled itself (same seed and step, same mask: exactly what
        token-by-token decoding would have produced), then the model's own next token. Returns that
        token and the accepted proposals; rejected ones lose their KV and grammar progress."""
        k, base = req.proposed, req.num_resolved
        samples, lps = out.proposal_samples[i], out.proposal_logprobs[i]
        props = req.output_ids[base:base + k]
        j = 0
        while j < k and samples[j] == props[j]:
            j += 1
        tok = samples[j]
        if j < k:
            self._leave_launching(req)  # its next pass read the sample after the last proposal
        # Rejected proposals go; the sample's placeholder (and a later step's, if any) stays.
        del req.output_ids[base + j:base + k]
        if j < k:
            req.grammar.rollback(k - j)
            self.policy.truncate_kv(req, len(req.input_ids) + base + j)
            self.runner.set_last_token(req.req_pool_idx, tok)
            out.logprobs[i], out.top_logprobs[i] = lps[j], None
        if req.return_logprob:
            for m in range(j):
                req.pending_output_logprobs.append([lps[m], props[m]])
                req.pending_output_top_logprobs.append([])
        req.num_resolved = base + j
        req.proposed, req.proposal_masks = 0, None
        self.jump_forward_tokens += j
        self.generated_tokens += j
        return tok, props[:j]

    # ------------------------------------------------------------------ speculative decoding
    def _draft(self, reqs: list[Req]) -> None:
        """Append drafts to the running requests that just took their tokens: the next pass verifies them
        (a catch-up extend pass; requests without drafts ride in it with their one token)."""
        k = self.spec.drafts_for(len(self.policy.running))
        if k == 0:
            return
        cands, budgets = [], []
        limit = self.runner.max_context_len
        for req in reqs:
            if (req.finished or req.proposed or req.status is not ReqStatus.RUNNING or req.req_pool_idx is None
                    or req.transfer_role == "prefill" or req.seq_len - req.kv_len != 1):
                continue
            # Room for the target's own token after the drafts, in max_new_tokens and the context.
            budget = min(k, req.params.max_new_tokens - req.num_resolved - 1, limit - req.seq_len - 1)
            if budget > 0:
                cands.append(req)
                budgets.append(budget)
        if not cands:
            return
        for req, drafts in zip(cands, self.spec.propose(cands, budgets)):
            if not drafts:
                continue
            self._leave_launching(req)  # only at a switch from overlapped steps (see step())
            if len(req.output_ids) != req.num_resolved:  # a placeholder of another pass in flight: not now
                continue
            if req.grammar is not None:
                drafts = self._grammar_drafts(req, drafts)
                if not drafts:
                    continue
            req.output_ids.extend(drafts)
            req.proposed, req.drafted = len(drafts), True

    def _grammar_drafts(self, req: Req, drafts: list[int]) -> list[int]:
        """The drafts the grammar allows (cut at the first it refuses), the matcher advanced over them, and
        the allowed-token mask at each draft position and after the last (the verification samples with
        them, as decoding token by token would)."""
        g = req.grammar
        masks = torch.full((len(drafts) + 1, (self.runner.vocab_size + 31) // 32), -1, dtype=torch.int32)
        filled = self.spec.filled_masks(req) or []  # the draft model's: filled while drafting, not again
        n = 0
        for t in drafts:
            if g.is_terminated():
                break
            if n >= len(filled) or not g.put_bitmask(masks, n, filled[n]):
                g.fill_bitmask(masks, n)
            if not g.try_accept(t):
                break
            n += 1
        self.spec.stats.grammar_cut += len(drafts) - n
        if n == 0:
            return []
        if not g.is_terminated():  # after a stop token the request ends: that row's sample is never taken
            g.fill_bitmask(masks, n)
        req.proposal_masks = masks[:n + 1]
        return drafts[:n]

    def _take_verified(self, req: Req, out: StepOutput, i: int) -> None:
        """A request's drafts came back verified: keep the longest prefix the target sampled itself, then
        the target's own next token, and take them one by one as decoding would (a stop token or string
        among them ends the request there, and what follows is dropped). Rejected drafts lose their KV."""
        k, base = req.proposed, req.num_resolved
        samples, lps = out.proposal_samples[i], out.proposal_logprobs[i]
        tops = out.proposal_top_logprobs.get(i)
        props = req.output_ids[base:base + k]
        j = 0
        while j < k and samples[j] == props[j]:
            j += 1
        if j < k:
            self._leave_launching(req)
            self.policy.truncate_kv(req, len(req.input_ids) + base + j)
            self.runner.set_last_token(req.req_pool_idx, samples[j])
        del req.output_ids[base + j:base + k]  # the pass's placeholder (now at base + j) stays
        if req.grammar is not None:
            req.grammar.rollback(k)  # taken again below, one by one
        req.proposed, req.proposal_masks, req.drafted = 0, None, False
        req.spec_verify_ct += 1
        stats = self.spec.stats
        stats.proposed += k
        stats.accepted += j
        stats.verifications += 1
        self.spec.verified(req, j)
        for m in range(j + 1):
            self._take_token(req, samples[m], [], lps[m], tops[m] if tops is not None else None)
            if req.finished:
                break
            if m < j and req.grammar is not None and self._jump_candidates and self._jump_candidates[-1][0] is req:
                self._jump_candidates.pop()  # only the last token taken may lead to a jump

    def _leave_launching(self, req: Req) -> None:
        """`req`'s next input just changed on the host (forced tokens appended, a proposal rejected):
        if the step being launched holds it, that row's result is ignored, its placeholder removed and
        the KV that row writes forgotten; the next pass extends the request from the right place."""
        handle = self._launching
        if handle is None:
            return
        batch = handle.batch
        i = next((m for m, r in enumerate(batch.reqs) if r is req), None)
        if i is None or i in handle.dropped:
            return
        handle.dropped.add(i)
        if batch.sample[i] and req.params.max_new_tokens > 0:
            req.output_ids.pop()  # that step's placeholder: always the last entry
        self.policy.truncate_kv(req, min(req.kv_len, batch.prefix_lens[i]))

    def _release(self, req: Req) -> None:
        """Drop tokens still pending on the device (from a step launched after the one that finished
        the request), then hand the request's KV to the cache. KV being written by a step still in
        flight is valid to share: later steps run after it on the same stream."""
        del req.output_ids[req.num_resolved:]
        req.kv_len = min(req.kv_len, req.seq_len)
        if req.transfer_role == "decode":
            self.decode_side.on_release(req)
        elif req.transfer_role == "prefill":
            self.prefill_side.on_release(req)
        self.policy.remove(req)
        self._reqs.pop(req.rid, None)
        if penalized(req.params):
            self._host_dependent -= 1
        if self.spec is not None:
            self.spec.release(req)

    def _make_output(self, req: Req) -> TokenOutput:
        new_ids = req.output_ids[req.sent_token_count:req.num_resolved]
        req.sent_token_count = req.num_resolved
        out = TokenOutput(
            rid=req.rid, token_ids=new_ids, text=req.pending_text, finished=req.finished,
            finish_reason=req.finish_reason, prompt_tokens=len(req.input_ids),
            cached_tokens=req.num_cached_tokens or 0, completion_tokens=req.num_resolved,
            output_logprobs=req.pending_output_logprobs, output_top_logprobs=req.pending_output_top_logprobs,
            queue_time=(req.first_scheduled_time or req.arrival_time) - req.arrival_time,
            spec_verify_ct=req.spec_verify_ct)
        req.pending_text = ""
        req.pending_output_logprobs, req.pending_output_top_logprobs = [], []
        if req.return_logprob and not req.input_logprobs_sent and (req.finished or req.kv_len >= len(req.input_ids)):
            out.input_logprobs, out.input_top_logprobs = req.input_logprobs, req.input_top_logprobs
            req.input_logprobs_sent = True
        return out

    # ------------------------------------------------------------------ for the PD halves (shared/pd/sides.py)
    def end_request(self, req: Req, error: str | None = None, reason: FinishReason | None = None) -> None:
        """End `req` now: an abort with `error`, or `reason` (e.g. FinishTransferred()); its KV goes to the
        tree, its stream gets the final output."""
        self._finish(req, reason if reason is not None else FinishAbort(message=error), error=error)

    def start_decoding(self, req: Req, first_token: int | None, logprob, top_logprobs) -> None:
        """A request whose prompt KV came from elsewhere (PD): take the first token sampled there (None:
        max_new_tokens 0, a cache warm-up) and stream it; it decodes from the next step on."""
        if first_token is None:
            req.finish_reason = FinishLength(length=0)
            if req.top_logprobs_num > 0:  # a top-k probe: the next position's top-k, computed there
                req.pending_output_top_logprobs.append(top_logprobs or [])
        else:
            req.output_ids.append(PENDING_TOKEN)
            self.runner.set_last_token(req.req_pool_idx, first_token)
            self._take_token(req, first_token, [], logprob, top_logprobs)
            self._settle_jumps()
        self._emit([req])

    def _finish(self, req: Req, reason: FinishReason, error: str | None = None, refused: bool = False,
                overloaded: bool = False) -> None:
        req.finish_reason = reason
        self._release(req)
        out = self._make_output(req)
        out.error, out.refused, out.overloaded = error, refused, overloaded
        self.on_output([out])

    def _emit_failed(self) -> None:
        while self.policy.failed:
            req = self.policy.failed.pop()
            msg = "the request does not fit in the KV cache"
            self._finish(req, FinishAbort(message=msg), error=msg, refused=True)

    # ------------------------------------------------------------------ fault isolation
    _MAX_STEP_FAILURES = 3

    def _recover(self, exc: Exception) -> None:
        """A step raised. Everything launched and not processed is dropped; requests of the batch that
        raised are suspects: one that was alone in it is at fault and ends with an error; the others
        (and every request of other dropped batches) go back to the queue with their trusted KV, a
        suspect to be re-run alone next. A suspect of three failed steps ends too, so an error that
        only shows in company cannot loop. Bystanders lose a little work, never their request."""
        self.failed_steps += 1
        failing, self._failing = self._failing, None
        dropped = list(self._inflight) + ([failing] if failing is not None and failing not in self._inflight else [])
        self._inflight.clear()
        self._pending = self._launching = None
        if failing is None:  # not in a batch (scheduling, the inbox): nothing to pin it on
            self._fail_all(f"internal error in the engine step ({type(exc).__name__})")
            return
        kv_len: dict[int, int] = {}
        reqs: dict[int, Req] = {}
        for b in dropped:
            for i, req in enumerate(b.reqs):
                kv_len[id(req)] = min(kv_len.get(id(req), b.prefix_lens[i]), b.prefix_lens[i])
                reqs[id(req)] = req
        suspects = {id(r) for r in failing.reqs}
        for key, req in reqs.items():
            if self._reqs.get(req.rid) is not req:
                continue  # already ended and released
            # KV the tree already holds (cached right after a launch that went through) stays.
            trusted = max(kv_len[key], req.cached_len)
            if req.finished:  # finished earlier in the processing loop that raised: deliver it
                req.kv_len = min(req.kv_len, trusted)
                self._emit([req])
                continue
            req.kv_len = min(req.kv_len, trusted)
            del req.output_ids[req.num_resolved:]  # values that never reached the host
            req.drop_proposals()
            if key in suspects:
                req.step_failures += 1
                if len(failing.reqs) == 1 or req.step_failures >= self._MAX_STEP_FAILURES or req.transfer_role:
                    self._fail_one(req, exc)
                    continue
                req.solo = True
            elif req.transfer_role:
                self._fail_one(req, exc)
                continue
            self.policy.requeue(req, req.kv_len)

    def _fail_one(self, req: Req, exc: Exception) -> None:
        msg = f"internal error while running this request ({type(exc).__name__}: {str(exc)[:200]})"
        if req in self._grammar_wait:
            self._grammar_wait.remove(req)
        try:
            self._finish(req, FinishAbort(message=msg), error=msg)
        except Exception:
            log.exception("failed to release %s", req.rid)
            self._reqs.pop(req.rid, None)

    def _fail_all(self, message: str) -> None:
        self._pending = None
        self._inflight.clear()
        for req in list(self._reqs.values()):
            try:
                self._finish(req, FinishAbort(message=message), error=message)
            except Exception:
                log.exception("failed to release %s", req.rid)
                self._reqs.pop(req.rid, None)

    # ------------------------------------------------------------------ admin (engine thread only)
    def flush_cache(self) -> tuple[bool, str]:
        if not self.policy.is_idle() or self.prefill_side.busy:
            return False, "cannot flush the cache while requests are running"
        self.cache.reset()
        return True, "cache flushed"

    def info(self) -> dict:
        total = self.runner.max_total_tokens
        free = self.allocator.available_size() + self.cache.evictable_size()
        return {
            "model_path": self.config.model_path,
            "max_context_len": self.runner.max_context_len,
            "max_total_tokens": total,
            "page_size": self.config.page_size,
            "vocab_size": self.runner.vocab_size,
            "device": str(self.runner.device),
            "dtype": str(self.runner.dtype).replace("torch.", ""),
            "kv_cache_dtype": str(self.runner.kv_dtype).replace("torch.", ""),
            "weight_format": self.runner.weight_format(),
            "num_running": self.policy.num_running(),
            "num_waiting": len(self.policy.waiting),
            "kv_usage": round(1.0 - free / total, 6) if total else 0.0,
            "cache": self.cache.stats(),
            "prompt_tokens": self.policy.stats.prompt_tokens,
            "cached_tokens": self.policy.stats.cached_tokens,
            "retractions": self.policy.stats.retractions,
            "failed_steps": self.failed_steps,
            "generated_tokens": self.generated_tokens,
            "steps": self.steps,
            "passes": dict(self.passes),
            "busy_period": dict(self.busy_period),
            "jump_forward_tokens": self.jump_forward_tokens,
            "jump_forward_declined": self.jump_forward_declined,
            "grammar_cache": {"hits": self.grammars.hits, "misses": self.grammars.misses, "entries": len(self.grammars)},
            "disable_radix_cache": self.config.disable_radix_cache,
            "hicache": self.cache.tiers() if self.config.enable_hierarchical_cache else None,
            "schedule_policy": self.config.schedule_policy,
            "tp_size": self.config.tp_size,
            "max_running_requests": self.config.max_running_requests,
            "chunked_prefill_size": self.config.chunked_prefill_size,
            "cuda_graphs": self.runner.graph_stats,
            **({"speculative": self.spec.info()} if self.spec is not None else {}),
        }
