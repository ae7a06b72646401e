"""Where an engine's time goes, pass by pass: for bench/structured.py (and anything else driving an
engine with bench.common.drive).

`PassBreakdown(engine)` wraps a few engine, scheduler and runner methods (instance attributes, taken
off again by `close()`) and records, per engine step that launched a pass:
- the pass's kind: `decode` (CUDA graph or eager), `admit` (an extend pass that admits prompts) or
  `catch-up` (an extend pass that admits nobody: it exists because requests jumped over forced text),
  its rows, its tokens, and its rows whose result was thrown away (`dropped`: the request jumped while
  the pass was in flight, so the row's token and sample are recomputed by a later pass);
- host time by phase (perf_counter), and the time the engine thread spent blocked on the device;
- on a GPU, the pass's device time (CUDA events around its forward, and to the end of its sampling).

Host phases (ms, per step): `schedule` (scheduler, incl. `cache` = KV entering the radix tree there), `kv-run`
(the pass's own KV entering the tree once its sampling is enqueued, where that leaves the same tree: on a
GPU while the device runs the pass, off the serial path), `launch`
(plan, slot table, batch tensors, kernel launches of the forward: on a CPU the forward itself, reported
apart as `model`), `wait` (blocked until the previous pass's results were on the host), `process` (the
previous pass's tokens: grammar, detokenizer, finish checks; incl. `jumps` = planning and taking
jump-forward), `masks` (grammar mask fill for this pass's sampling, incl. its copy), `sample` (the rest
of enqueuing the sampling). `host` = the step's wall time less `wait` (and less `model` on a CPU).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from shared.engine.forward_batch import ForwardMode

PHASES = ("schedule", "cache", "kv-run", "launch", "model", "wait", "process", "jumps", "masks", "sample")


@dataclass
class PassRecord:
    kind: str
    rows: int
    tokens: int
    graph: bool = False
    dropped: int = 0
    wall: float = 0.0
    phases: dict = field(default_factory=lambda: defaultdict(float))
    events: tuple | None = None  # (start, forward enqueued, sampling done) CUDA events


class PassBreakdown:
    def __init__(self, engine):
        self.eng = engine
        self.cuda = engine.runner.device.type == "cuda"
        self.records: list[PassRecord] = []
        self._step: dict = defaultdict(float)  # phases of the step under way
        self._cur: PassRecord | None = None
        self._handles: list = []
        self._patched: list = []
        eng, sched, runner = engine, engine.scheduler, engine.runner
        self._wrap(sched, "schedule", "schedule")
        self._wrap(sched, "_cache_extended", "cache")
        self._wrap(sched, "cache_extended_apart", "kv-run")
        self._wrap(eng, "_settle_jumps", "jumps")
        self._wrap(runner.masker, "build", "masks")
        self._wrap(runner, "_proposal_masks", "masks")
        self._wrap(runner.model, "forward", "model")
        self._wrap(runner.model, "compute_logits", "model")
        self._wrap_step()
        self._wrap_launch()
        self._wrap_resolve()
        self._wrap_sample()

    # ------------------------------------------------------------------ wrapping
    def _set(self, obj, name, fn):
        had = name in obj.__dict__
        self._patched.append((obj, name, obj.__dict__.get(name), had))
        setattr(obj, name, fn)

    def close(self) -> None:
        for obj, name, old, had in reversed(self._patched):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._patched = []
        self._finish_handles()

    def _wrap(self, obj, name, phase):
        orig = getattr(obj, name)
        acc = self._step

        def wrapped(*a, **kw):
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                acc[phase] += time.perf_counter() - t
        self._set(obj, name, wrapped)

    def _wrap_step(self):
        eng = self.eng
        orig = eng.step

        def step():
            self._step.clear()
            self._cur = None
            t = time.perf_counter()
            try:
                return orig()
            finally:
                # A step that launched nothing (it only processed the last pass, or waited for a grammar
                # to compile) counts as one of its own, so the records add up to the run.
                rec = self._cur if self._cur is not None else PassRecord("no pass", 0, 0)
                rec.wall = time.perf_counter() - t
                rec.phases.update(self._step)
                self.records.append(rec)
        self._set(eng, "step", step)

    def _wrap_launch(self):
        runner, sched = self.eng.runner, self.eng.scheduler
        orig_schedule, orig_plan, orig_launch = sched.schedule, runner._plan, runner.launch
        state = {"kind": None, "graph": False}

        def schedule():
            before = set(map(id, sched.running))  # an extend of these alone admits nobody: catch-up
            batch = orig_schedule()
            if batch is not None:
                state["kind"] = "decode" if batch.mode == ForwardMode.DECODE else (
                    "catch-up" if all(id(r) in before for r in batch.reqs) else "admit")
            return batch

        def plan(batch):
            p = orig_plan(batch)
            state["graph"] = p.use_graph
            return p

        def launch(batch):
            t = time.perf_counter()
            rec = PassRecord(state["kind"] or batch.mode.value, batch.batch_size, sum(batch.extend_lens))
            ev = None
            if self.cuda:
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                ev[0].record()
            handle = orig_launch(batch)
            rec.graph = state["graph"]
            if self.cuda:
                ev[1].record()
                if handle.deferred is None:  # sampled inside launch (no grammar in the batch)
                    ev.append(ev[1])
            rec.events = ev
            self._cur = rec
            self._handles.append((handle, rec))
            self._step["launch"] += time.perf_counter() - t
            return handle
        self._set(sched, "schedule", schedule)
        self._set(runner, "_plan", plan)
        self._set(runner, "launch", launch)

    def _wrap_resolve(self):
        eng = self.eng
        orig_process = eng._process

        def process(batch, out, dropped=frozenset()):
            t = time.perf_counter()
            try:
                return orig_process(batch, out, dropped)
            finally:
                self._step["process"] += time.perf_counter() - t
        self._set(eng, "_process", process)
        orig_resolve = eng._resolve_pending

        def resolve_pending():
            pending = eng._pending
            if pending is None:
                return orig_resolve()
            # resolve() (the wait and the copy out) is what precedes _process inside _resolve_pending.
            inner = pending.resolve

            def timed_resolve():
                t = time.perf_counter()
                try:
                    return inner()
                finally:
                    self._step["wait"] += time.perf_counter() - t
            pending.resolve = timed_resolve
            return orig_resolve()
        self._set(eng, "_resolve_pending", resolve_pending)

    def _wrap_sample(self):
        runner = self.eng.runner
        orig = runner.sample_pending

        def sample_pending(handle):
            t = time.perf_counter()
            masks0 = self._step["masks"]
            model0 = self._step["model"]
            try:
                return orig(handle)
            finally:
                rec = next((r for h, r in reversed(self._handles) if h is handle), None)
                if rec is not None and rec.events is not None and len(rec.events) == 2:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    rec.events.append(end)
                self._step["sample"] += (time.perf_counter() - t - (self._step["masks"] - masks0)
                                         - (self._step["model"] - model0))
        self._set(runner, "sample_pending", sample_pending)

    def _finish_handles(self):
        for handle, rec in self._handles:
            rec.dropped = len(handle.dropped)
        self._handles = []

    # ------------------------------------------------------------------ results
    def summary(self) -> dict:
        self._finish_handles()
        if self.cuda:
            torch.cuda.synchronize()
        groups: dict[str, list[PassRecord]] = defaultdict(list)
        for r in self.records:
            key = r.kind + (" (graph)" if r.kind == "decode" and r.graph else "")
            groups[key].append(r)
        out = {}
        total_wall = sum(r.wall for r in self.records)
        for key, recs in list(groups.items()) + [("all", self.records)]:
            n = len(recs)
            if not n:
                continue
            ph = {p: sum(r.phases.get(p, 0.0) for r in recs) / n * 1e3 for p in PHASES}
            # schedule includes cache; launch includes the model forward's host side (all of it on a CPU);
            # process includes jumps.
            host = sum(r.wall - r.phases.get("wait", 0.0) - (0.0 if self.cuda else r.phases.get("model", 0.0))
                       for r in recs) / n * 1e3
            d = {"passes": n, "rows": sum(r.rows for r in recs) / n, "tokens": sum(r.tokens for r in recs) / n,
                 "dropped_rows": sum(r.dropped for r in recs), "wall_ms": sum(r.wall for r in recs) / n * 1e3,
                 "host_ms": host, "phases_ms": ph}
            evs = [r.events for r in recs if r.events is not None and len(r.events) == 3]
            if evs:
                d["gpu_forward_ms"] = sum(a.elapsed_time(b) for a, b, _ in evs) / len(evs)
                d["gpu_pass_ms"] = sum(a.elapsed_time(c) for a, _, c in evs) / len(evs)
                d["gpu_total_ms"] = d["gpu_pass_ms"] * len(evs)
            out[key] = d
        a = out["all"]
        a["total_wall_s"] = total_wall
        if "gpu_total_ms" in a and total_wall > 0:
            # Share of the run the device spent inside passes (start of a forward to the end of its
            # sampling, gaps inside a pass included): the rest it waited for the host.
            a["gpu_busy_frac"] = a["gpu_total_ms"] / 1e3 / total_wall
        return out


def format_summary(s: dict, title: str) -> str:
    cols = ["passes", "rows", "tokens", "dropped", "wall", "host", "gpu fwd", "gpu pass"] + list(PHASES)
    a = s.get("all", {})
    gpu = "gpu_pass_ms" in a
    head = (f"{title}: {a.get('total_wall_s', 0):.3f} s in steps; per pass, ms (host = wall - wait"
            + ("" if gpu else " - model: on a CPU `model` and `sample` are the model's compute") + ")")
    if "gpu_busy_frac" in a:
        head += f"; device busy {100 * a['gpu_busy_frac']:.0f}% of the run"
    lines = [head, "  " + f"{'kind':16s}" + "".join(f"{c:>9s}" for c in cols)]
    for key, d in s.items():
        row = [f"{d['passes']:9d}", f"{d['rows']:9.1f}", f"{d['tokens']:9.0f}", f"{d['dropped_rows']:9d}",
               f"{d['wall_ms']:9.2f}", f"{d['host_ms']:9.2f}",
               f"{d.get('gpu_forward_ms', float('nan')):9.2f}", f"{d.get('gpu_pass_ms', float('nan')):9.2f}"]
        row += [f"{d['phases_ms'][p]:9.2f}" for p in PHASES]
        lines.append("  " + f"{key:16s}" + "".join(row))
    return "\n".join(lines)
