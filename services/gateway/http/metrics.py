"""Prometheus metrics under SGLang's names (`sglang:*`), in a registry of our own (several gateways may
live in one process). In a --gateway-processes pool every process's values live in
$PROMETHEUS_MULTIPROC_DIR and any process renders them all; the hit rate, a ratio, is rebuilt from every
process's window counts."""
from __future__ import annotations

import asyncio
import collections
import itertools
import os
import time

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import GaugeMetricFamily

from shared.protocol import FinishAbort, TokenOutput

# `*_created` timestamp series double the exposition and no dashboard reads them.
disable_created_metrics()

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5)

# cache_hit_rate and gen_throughput are rates over about this many recent seconds (SGLang's are over its
# logging interval); the counters stay the exact source.
RATE_WINDOW_S = 10.0
# Each process of a pool publishes its window's token counts this often (any of them may render).
PUBLISH_INTERVAL_S = 1.0
_HIT_WINDOW = ("gateway_window_cached_tokens", "gateway_window_queried_tokens")  # a pool's internal series
_HIT_DOC = (f"Prompt tokens served from the prefix cache / prompt tokens, over the last ~{RATE_WINDOW_S:.0f} s "
            "of finished requests")


def multiprocess_dir() -> str | None:
    """The pool's shared metrics directory, when this gateway is one of several processes."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class HostTierGauges:
    """The workers' host KV tier (--enable-hierarchical-cache), summed over them: per-tier hit tokens, bytes moved
    each way, tier sizes, and the load-back latency histogram (as gauges: the workers' own counts)."""

    # name -> (help, the section of the workers' info and its key summed into it)
    FIGURES = {"hicache_host_hit_tokens": ("Prompt tokens loaded back from the host KV tier", "cache", "host_hit_tokens"),
               "hicache_device_hit_tokens": ("Prompt tokens found in the device KV pool", "cache", "hit_tokens"),
               "hicache_h2d_bytes": ("KV bytes loaded from the host tier to the device", "cache", "bytes_h2d"),
               "hicache_d2h_bytes": ("KV bytes written from the device to the host tier", "cache", "bytes_d2h"),
               "hicache_host_used_tokens": ("Host tier slots in use", "hicache", "host_used_tokens"),
               "hicache_host_total_tokens": ("Host tier size in tokens", "hicache", "host_total_tokens"),
               "hicache_load_seconds_sum": ("Total seconds of host tier load-backs", "cache", "load_seconds_sum"),
               "hicache_load_seconds_count": ("Host tier load-backs completed", "cache", "load_seconds_count")}

    def __init__(self, gauge, registry, model_name: str):
        self.gauges = {name: gauge(name, doc) for name, (doc, _, _) in self.FIGURES.items()}
        self.buckets = Gauge("sglang:hicache_load_seconds_bucket", "Host tier load-backs that took at most `le` s",
                             ["model_name", "le"], registry=registry, multiprocess_mode="livemostrecent")
        self.model_name = model_name

    def set(self, infos: list[dict]) -> None:
        sections = {"cache": [i.get("cache") or {} for i in infos], "hicache": [i["hicache"] for i in infos]}
        for name, (_, section, key) in self.FIGURES.items():
            value = sum(_num(d.get(key)) for d in sections[section])
            if name == "hicache_device_hit_tokens":  # a worker's hit_tokens count the host tier's too
                value -= sum(_num(c.get("host_hit_tokens")) for c in sections["cache"])
            self.gauges[name].set(value)
        caches = sections["cache"]
        bounds = [str(b) for b in caches[0].get("load_latency_le") or []] + ["+Inf"]
        counts = [0.0] * len(bounds)
        for c in caches:
            for k, n in enumerate((c.get("load_latency_buckets") or [])[:len(counts)]):
                counts[k] += _num(n)
        for bound, total in zip(bounds, itertools.accumulate(counts)):  # a bucket counts every one below it
            self.buckets.labels(self.model_name, bound).set(total)


class GatewayMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.multiprocess = multiprocess_dir() is not None
        labels = ["model_name"]
        r = self.registry
        self.model_name = model_name

        def counter(name, doc):
            return Counter(f"sglang:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"sglang:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        def gauge(name, doc, mode="livemostrecent"):
            # mode: how a pool's processes combine (ignored in one process); the workers' figures are
            # the same seen from any process, the last polled wins.
            return Gauge(f"sglang:{name}", doc, labels, registry=r, multiprocess_mode=mode).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache")
        self.queried_prefix_tokens = counter(
            "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache (hit rate denominator)")
        self.requests = counter("num_requests", "Finished requests")
        self.aborted_requests = counter("num_aborted_requests", "Requests aborted or failed")
        self.pd_bypassed = counter("num_pd_bypassed_requests",
                                   "PD requests a decode worker extended itself (short uncached suffix)")
        self.pd_retried = counter("num_pd_retried_requests",
                                  "PD requests restarted elsewhere after a worker failed before the first token")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between output tokens", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS)
        self.queue_time = histogram("queue_time_seconds", "Time waiting in a worker queue", _LATENCY_BUCKETS)
        self.num_running = gauge("num_running_reqs", "Requests running on the workers")
        self.num_queued = gauge("num_queue_reqs", "Requests waiting on the workers")
        self.token_usage = gauge("token_usage", "KV cache usage, fraction of the pool (mean over workers)")
        self.gateway_inflight = gauge("gateway_inflight_reqs", "Requests the gateway is waiting on", "livesum")
        self.num_used_tokens = gauge("num_used_tokens", "KV cache slots in use, summed over workers")
        self._gauge = gauge
        self.hicache: HostTierGauges | None = None  # made when a worker first reports a host KV tier
        if self.multiprocess:  # a ratio does not sum: each process publishes its window's two counts
            self.hit_window = [gauge(name, "(internal)", "livesum") for name in _HIT_WINDOW]
        else:
            self.cache_hit_rate = gauge("cache_hit_rate", _HIT_DOC)
        self.gen_throughput = gauge("gen_throughput", "Generated tokens per second, over the last "
                                    f"~{RATE_WINDOW_S:.0f} s", "livesum")
        # Cache-aware routing (services/gateway/routing/cache_aware.py) and its exact index, set at each render.
        self.routing_decisions = Gauge("sglang:routing_decisions", "Requests routed, by index (exact | "
                                       "approximate) and reason (cache | load | new)",
                                       labels + ["index", "reason"], registry=r, multiprocess_mode="livesum")
        self.kv_index_blocks = gauge("kv_index_blocks", "Blocks in the exact KV index (all workers)", "livemax")
        self.kv_index_synced = gauge("kv_index_synced_workers", "Workers whose exact KV picture is current", "livemin")
        self.kv_index_lag = gauge("kv_event_lag_p99_seconds", "KV event lag, stored on a worker to applied here, "
                                  "p99 of recent batches", "livemax")
        self.kv_index_events = Gauge("sglang:kv_index_events", "KV event stream entries by outcome (batches, "
                                     "gaps, resyncs, rejected_*)", labels + ["outcome"], registry=r,
                                     multiprocess_mode="livesum")
        # Totals the rates are computed from: streamed tokens count when they arrive, not at the end.
        self.streamed_tokens = self.cached_total = self.queried_total = 0
        self._samples: collections.deque = collections.deque([(time.monotonic(), 0, 0, 0)])
        self._publisher: asyncio.Task | None = None

    def set_worker_stats(self, infos: list[dict]) -> None:
        self.num_running.set(sum(_num(i.get("num_running")) for i in infos))
        self.num_queued.set(sum(_num(i.get("num_waiting")) for i in infos))
        self.num_used_tokens.set(sum(_num(i.get("kv_usage")) * _num(i.get("max_total_tokens")) for i in infos))
        if infos:
            self.token_usage.set(sum(_num(i.get("kv_usage")) for i in infos) / len(infos))
        tiered = [i for i in infos if i.get("hicache")]
        if tiered:
            if self.hicache is None:
                self.hicache = HostTierGauges(self._gauge, self.registry, self.model_name)
            self.hicache.set(tiered)

    def set_routing_stats(self, stats: dict) -> None:
        """The router's stats (Router.stats): decisions, and the exact index's size, lag and counts."""
        for key, n in stats.get("decisions", {}).items():
            index, reason = key.split("/", 1)
            self.routing_decisions.labels(self.model_name, index, reason).set(n)
        exact = stats.get("exact_index")
        if exact:
            self.kv_index_blocks.set(exact["blocks"])
            self.kv_index_synced.set(exact["synced_workers"])
            self.kv_index_lag.set(exact["event_lag_p99_s"])
            for outcome in ("batches", "gaps", "resyncs", "rejected_unauthenticated", "rejected_unknown_worker",
                            "rejected_malformed"):
                self.kv_index_events.labels(self.model_name, outcome).set(exact[outcome])

    def update_rates(self, now: float | None = None) -> None:
        """Set the two rate gauges from the totals' change since the oldest sample in the window."""
        now = time.monotonic() if now is None else now
        current = (now, self.streamed_tokens, self.cached_total, self.queried_total)
        samples = self._samples
        while len(samples) > 1 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()  # keep exactly one sample at least a window old (or the start)
        t0, gen0, cached0, queried0 = samples[0]
        if now > t0:
            self.gen_throughput.set((current[1] - gen0) / (now - t0))
        cached, queried = current[2] - cached0, current[3] - queried0
        if self.multiprocess:
            for gauge, value in zip(self.hit_window, (cached, queried)):
                gauge.set(value)
        else:
            self.cache_hit_rate.set(cached / queried if queried > 0 else 0.0)
        samples.append(current)

    def start_publishing(self) -> None:
        """In a pool: refresh this process's rate figures every PUBLISH_INTERVAL_S (a scrape may be
        rendered by any process, from what the others last published)."""
        if self.multiprocess and self._publisher is None:
            self._publisher = asyncio.get_running_loop().create_task(self._publish_forever(),
                                                                     name="metrics-publish")

    async def stop_publishing(self) -> None:
        task, self._publisher = self._publisher, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _publish_forever(self) -> None:
        while True:
            self.update_rates()
            await asyncio.sleep(PUBLISH_INTERVAL_S)

    def render(self) -> bytes:
        self.update_rates()
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client.multiprocess import MultiProcessCollector

        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=multiprocess_dir())
        return generate_latest(_PoolView(merged, self.model_name))


class _PoolView:
    """Every process's series, merged (MultiProcessCollector), with the hit rate rebuilt from the
    processes' window counts in place of those internal series."""

    def __init__(self, merged: CollectorRegistry, model_name: str):
        self.merged, self.model_name = merged, model_name

    def collect(self):
        sums = {f"sglang:{name}": 0.0 for name in _HIT_WINDOW}
        for family in self.merged.collect():
            if family.name in sums:
                sums[family.name] = sum(s.value for s in family.samples)
                continue
            yield family
        cached, queried = sums.values()
        rate = GaugeMetricFamily("sglang:cache_hit_rate", _HIT_DOC, labels=["model_name"])
        rate.add_metric([self.model_name], cached / queried if queried > 0 else 0.0)
        yield rate


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


class RequestTimer:
    """Timing of one request's stream: feeds TTFT, ITL, queue time and the token counters."""

    __slots__ = ("m", "start", "last")

    def __init__(self, metrics: GatewayMetrics):
        self.m = metrics
        self.start = time.perf_counter()
        self.last: float | None = None

    def observe(self, out: TokenOutput) -> float:
        """Account one increment; returns the time it was taken (perf_counter)."""
        now = time.perf_counter()
        n = len(out.token_ids)
        m = self.m
        m.streamed_tokens += n
        last = self.last
        if last is None:
            if out.queue_time > 0:
                m.queue_time.observe(out.queue_time)
            if n:
                m.ttft.observe(now - self.start)
                self.last = now
        elif n:
            gap = (now - last) / n  # a frame may carry several tokens (jump-forward, --stream-interval)
            for _ in range(n):
                m.itl.observe(gap)
            self.last = now
        if out.finished:
            m.requests.inc()
            m.prompt_tokens.inc(out.prompt_tokens)
            m.queried_prefix_tokens.inc(out.prompt_tokens)
            m.cached_tokens.inc(out.cached_tokens)
            m.cached_total += out.cached_tokens
            m.queried_total += out.prompt_tokens
            m.generation_tokens.inc(out.completion_tokens)
            m.e2e.observe(now - self.start)
            if isinstance(out.finish_reason, FinishAbort) or out.error:
                m.aborted_requests.inc()
        return now
