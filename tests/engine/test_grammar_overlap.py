"""Grammar masks off the critical path: with overlap on, a step holding constrained requests launches
its forward pass, then the previous step's tokens are processed (the grammars take them), then the
host fills this step's masks while the device runs the forward, and only then is sampling enqueued.
Outputs are those of strictly sequential steps."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from shared.models.forward_batch import ForwardMode
from shared.engine.request import PENDING_TOKEN
from tests.support.engine_harness import Harness
from tests.engine.test_grammar import REGEXES, SCHEMA, prompt

UNCONSTRAINED = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
# Retokenizing parity runs jump every forced run: with --jump-forward-threshold above 0 whether a run is
# jumped depends on the batch around it (running and waiting requests, which grammar compile times on
# threads vary), and a jumped run is tokenized differently from a decoded one.
RETOKENIZE = {"jump_forward_mode": "retokenize", "jump_forward_threshold": 0}


def _requests():
    reqs = [{"json_schema": json.dumps(SCHEMA), "temperature": 0, "max_new_tokens": 160},
            {"regex": REGEXES[0], "temperature": 0, "max_new_tokens": 40},
            {"regex": REGEXES[2], "temperature": 0, "max_new_tokens": 60},
            {"json_schema": json.dumps(SCHEMA), "temperature": 1.0, "seed": 5, "max_new_tokens": 160}]
    return reqs + [UNCONSTRAINED]


class _Trace:
    """Order of the runner's calls: a step's forward launched, its masks filled, its results waited on."""

    def __init__(self, engine):
        self.events: list[tuple[str, int]] = []  # (what, step number)
        self.extend_with_pending = 0
        self.seq: dict[int, int] = {}  # id(batch) -> step number (ids are reused: the latest wins)
        self._count = itertools.count()
        runner = engine.runner
        launch, sample_pending, build = runner.launch, runner.sample_pending, runner.masker.build
        trace = self

        def traced_launch(batch):
            if batch.mode == ForwardMode.EXTEND and PENDING_TOKEN in batch.input_ids:
                trace.extend_with_pending += 1
            step = trace.seq[id(batch)] = next(trace._count)
            handle = launch(batch)
            trace.events.append(("launch", step))
            resolve = handle.resolve

            def traced_resolve():
                trace.events.append(("wait", step))
                return resolve()
            handle.resolve = traced_resolve
            return handle

        def traced_sample_pending(handle):
            trace.events.append(("sample", trace.seq[id(handle.batch)]))
            return sample_pending(handle)

        def traced_build(states, device=None):
            if any(s is not None for s in states):
                trace.events.append(("fill", -1))
            return build(states, device=device)

        runner.launch, runner.sample_pending, runner.masker.build = traced_launch, traced_sample_pending, traced_build

    def steps(self):
        """Per step with a mask fill: (launch index, fill index, wait index, index of the wait on the
        step before it, if that wait came after this launch)."""
        pos = {}
        for n, (kind, b) in enumerate(self.events):
            pos.setdefault((kind, b), n)
        order = [b for kind, b in self.events if kind == "launch"]
        out = []
        for k, b in enumerate(order):
            start = pos[("launch", b)]
            fills = [n for n, (kind, _) in enumerate(self.events) if kind == "fill" and self._owner(n) == b]
            if not fills:
                continue
            prev_wait = pos.get(("wait", order[k - 1])) if k else None
            out.append((start, fills[0], pos.get(("wait", b)), prev_wait))
        return out

    def _owner(self, n):
        """The step whose sampling the fill at event n belongs to (the last 'sample' before it)."""
        for kind, b in reversed(self.events[:n]):
            if kind == "sample":
                return b
        return None


def _run(h: Harness, reqs):
    return [r["ids"] for r in h.run([h.submit(prompt(), sampling=s) for s in reqs])]


@pytest.mark.parametrize("mode", ["off", "retokenize", "verify"])
def test_masks_fill_between_the_forward_launch_and_the_wait(mode):
    jf = {"off": {"disable_jump_forward": True}, "retokenize": RETOKENIZE, "verify": {"jump_forward_mode": mode}}[mode]
    h = Harness(**jf)
    trace = _Trace(h.engine)
    got = _run(h, _requests())
    steps = trace.steps()
    assert steps, "no step filled a mask"
    for launch, fill, wait, _ in steps:
        # The fill must follow the forward's launch and precede the wait on its results: a fill after
        # the wait (or inside the launch) would add to the step instead of hiding behind the forward.
        assert launch < fill < wait, (launch, fill, wait)
    # Overlap: the previous step's tokens were processed after this step's forward was launched and
    # before its masks were filled (the grammars had to take them first). With jump-forward, a step
    # whose tokens will likely make jumps is processed before the next is scheduled instead (Engine.step:
    # the next pass extends the forced runs at once); every other step overlaps.
    overlapped = [s for s in steps if s[3] is not None and s[0] < s[3] < s[1]]
    processed_first = [s for s in steps if s[3] is not None and s[3] < s[0]]
    assert len(overlapped) + len(processed_first) == len([s for s in steps if s[3] is not None])
    if mode == "off":
        assert not processed_first and len(overlapped) >= len(steps) // 2, (len(overlapped), len(steps))
    else:
        assert overlapped and processed_first, (len(overlapped), len(processed_first))
    ref = Harness(enable_overlap=False, **jf)
    assert got == _run(ref, _requests())
    for x in (h, ref):
        assert x.engine.policy.is_idle() and x.free_tokens() == x.engine.runner.max_total_tokens


@pytest.mark.parametrize("cfg", [{}, {"page_size": 4}])
def test_jump_forward_under_overlap_drops_the_stale_row_and_keeps_outputs(cfg):
    """Retokenizing jump-forward appends forced tokens while the next step, already launched, decodes
    the request from the sampled token: that row is dropped and the forced run extends next, with
    the other requests riding along (their last token still on the device). The engine avoids this
    while jumps are likely (it processes such steps before scheduling the next); here it is told
    they never are, so every jump meets a launched step."""
    h = Harness(**RETOKENIZE, **cfg)
    h.engine._jumps_likely_after = lambda handle: False
    trace = _Trace(h.engine)
    dropped = []
    sample_pending = h.engine.runner.sample_pending

    def counting(handle):
        dropped.append(len(handle.dropped))
        return sample_pending(handle)
    h.engine.runner.sample_pending = counting
    got = _run(h, _requests())
    assert sum(dropped) > 0 and trace.extend_with_pending > 0
    ref = Harness(**RETOKENIZE, enable_overlap=False, **cfg)
    assert got == _run(ref, _requests())
    assert h.engine.policy.is_idle() and h.free_tokens() == h.engine.runner.max_total_tokens


def test_mask_timing_records_each_masked_step():
    h = Harness(disable_jump_forward=True)
    h.engine.runner.mask_timing = []
    _run(h, _requests()[:2])
    timing = h.engine.runner.mask_timing
    assert timing and all(rows >= 1 and host_s >= 0 for _, _, rows, host_s in timing)
    if h.engine.runner.device.type == "cuda":  # CUDA events around the fill: their gap is the unhidden part
        torch.cuda.synchronize()
        assert all(start.elapsed_time(end) >= 0 for start, end, _, _ in timing)
    else:  # host clock readings
        assert all(end >= start and host_s == end - start for start, end, _, host_s in timing)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("threshold", [0, 3])
def test_every_decode_input_is_the_hosts_token_after_jumps(overlap, threshold):
    """A decode pass reads its inputs from the device (token_buf). Wherever the host already knows the
    token at the position being decoded, the device must hold that token: in particular after a
    retokenizing jump that rolled back the sampled token and added one token (one token to compute, so
    a decode pass, not a catch-up extend), which left the rolled-back sample there before."""
    h = Harness(jump_forward_mode="retokenize", jump_forward_threshold=threshold, enable_overlap=overlap)
    runner, engine = h.engine.runner, h.engine
    checked, swaps = [0], [0]
    launch, jump = runner.launch, engine._jump_forward

    def checking_launch(batch):
        if batch.mode == ForwardMode.DECODE:
            for req, p in zip(batch.reqs, batch.prefix_lens):
                want = req.all_ids[p]
                if want != PENDING_TOKEN:
                    assert int(runner.token_buf[req.req_pool_idx]) == want, (req.rid, p)
                    checked[0] += 1
        return launch(batch)

    def counting_jump(req, jf):
        swaps[0] += jf.rollback == 1 and len(jf.new_ids) == 1
        return jump(req, jf)
    runner.launch, engine._jump_forward = checking_launch, counting_jump
    got = _run(h, _requests())
    if threshold == 0 or not overlap:
        # Without jumps under overlap every decode input is still pending on the host (nothing to check).
        assert checked[0] > 0
    if threshold == 0:  # every forced run jumped (at 3, how many are depends on the batch around them)
        assert swaps[0] > 0, "no jump swapped the sample for one token: the case is not exercised"
    ref = Harness(disable_jump_forward=True)
    for ids, ref_ids, s in zip(got, _run(ref, _requests()), _requests()):
        if "regex" not in s and "json_schema" not in s:
            assert ids == ref_ids  # unconstrained riders are unaffected by the others' jumps


def test_while_jumping_no_pass_is_wasted():
    """Requests in lockstep over one schema jump after nearly every sampled token. With the next step
    launched before those tokens are known, each jump drops the request's row of that step and its
    forced run waits a pass more; the engine processes a step whose tokens will likely jump before
    scheduling the next, so the forced runs extend at once: fewer passes, (almost) no dropped rows,
    the same outputs."""
    reqs = [{"json_schema": json.dumps(SCHEMA), "temperature": 0, "max_new_tokens": 160}] * 6

    def run(likely):
        h = Harness(**RETOKENIZE)
        if likely is not None:
            h.engine._jumps_likely_after = likely
        dropped, passes = [], [0]
        launch, sample_pending = h.engine.runner.launch, h.engine.runner.sample_pending

        def counting_launch(batch):
            passes[0] += 1
            return launch(batch)

        def counting(handle):
            dropped.append(len(handle.dropped))
            return sample_pending(handle)
        h.engine.runner.launch, h.engine.runner.sample_pending = counting_launch, counting
        got = _run(h, reqs)
        assert h.engine.policy.is_idle() and h.free_tokens() == h.engine.runner.max_total_tokens
        return got, passes[0], sum(dropped)

    got, passes, dropped = run(None)
    old, old_passes, old_dropped = run(lambda handle: False)
    assert got == old
    assert old_dropped >= 2 * len(reqs) and dropped < old_dropped // 2, (dropped, old_dropped)
    assert passes < old_passes, (passes, old_passes)
