"""Shared pieces of the benchmarks: device ceilings, model directories of real shapes, an engine driver."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import torch

from shared.models.config import ModelConfig
from shared.protocol import GenerateRequest, merge_outputs
from shared.sampling_params import SamplingParams
from shared.tokenizer import save_tiny_tokenizer

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
TINY = {**LLAMA31_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
# The tiny model with the 8B's vocabulary width: host work that scales with the vocabulary (grammar mask
# fill and copy, sampling rows) costs on a CPU what it costs beside the 8B model.
TINY_WIDE = {**TINY, "vocab_size": LLAMA31_8B["vocab_size"]}
SHAPES = {"llama-3.1-8b": LLAMA31_8B, "tiny": TINY, "tiny-wide": TINY_WIDE}


def model_dir(shape: str, root: str = "/tmp/bench-models", quantization_config: dict | None = None,
              suffix: str = "") -> str:
    """config.json of the shape + a small tokenizer: loads with --load-format dummy (random weights); with
    `quantization_config` (in a directory named shape + suffix) the dummy weights take that checkpoint format."""
    path = os.path.join(root, shape + suffix)
    os.makedirs(path, exist_ok=True)
    config = dict(SHAPES[shape], **({"quantization_config": quantization_config} if quantization_config else {}))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_tiny_tokenizer(path)
    return path


def param_bytes(cfg: dict, bytes_per=2) -> int:
    return ModelConfig.from_hf(cfg).num_params * bytes_per


def matmul_params(cfg: dict) -> int:
    """Parameters touched by matmuls per token (embedding lookup excluded, lm_head included)."""
    return param_bytes(cfg, 1) - cfg["vocab_size"] * cfg["hidden_size"]


def prefill_flops_per_token(cfg: dict, prompt_len: int) -> float:
    """FLOPs a prompt token of a prompt_len-token prompt costs: the matmuls, and causal attention's two matmuls
    (on average half the prompt before each token)."""
    return 2 * matmul_params(cfg) + 2 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["head_dim"] * prompt_len


def full_pass_rate(st: "RunStats", min_tokens: int) -> tuple[float, float]:
    """Tokens a second over a timed run's (drive(time_steps=True)) extend passes of at least min_tokens, and their
    mean seconds a pass; nan, nan where there is none."""
    full = [(t, k) for t, k in zip(st.extend_step_s, st.extend_step_tokens) if k >= min_tokens]
    if not full:
        return float("nan"), float("nan")
    return sum(k for _, k in full) / sum(t for t, _ in full), sum(t for t, _ in full) / len(full)


def kv_bytes_per_token(cfg: dict, bytes_per=2) -> int:
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * bytes_per


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    if not torch.cuda.is_available():
        return float("nan")
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    b = torch.empty_like(a)
    times = []
    for _ in range(25):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    t = sorted(times[5:])[len(times[5:]) // 2]
    return 2 * nbytes / t


def measure_matmul_tflops(n: int = 8192) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    xs = [torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    w = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    times = []
    for i in range(30):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        xs[i % 3] @ w
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    t = sorted(times[5:])[len(times[5:]) // 2]
    return 2 * n ** 3 / t / 1e12


def measure_matmul_sustained(seconds: float = 3.0, n: int = 8192, group: int = 8) -> float:
    """The bf16 matmul rate the board sustains: 8192^3 GEMMs back to back for `seconds` (the host keeps one group
    queued ahead, so the GPU never waits on it), the rate over the second half. A prefill of seconds runs at these
    clocks, not at the short-burst ones measure_matmul_tflops reads on a cool GPU (0.85-0.95 of them on H100 and H200
    boards, which cap their power: docs/performance.md)."""
    if not torch.cuda.is_available():
        return float("nan")
    xs = [torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    w = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    marks = [torch.cuda.Event(enable_timing=True)]
    marks[0].record()
    t0 = time.perf_counter()
    while True:
        for i in range(group):
            torch.mm(xs[i % 3], w, out=out)
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
        if len(marks) > 2:
            marks[-3].synchronize()  # one group in flight behind the one just queued
        if time.perf_counter() - t0 > seconds:
            break
    marks[-1].synchronize()
    ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    half = ms[len(ms) // 2:]
    return 2 * n ** 3 * group * len(half) / (sum(half) / 1e3) / 1e12


@dataclass
class RunStats:
    wall_s: float = 0.0
    steps: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    extend_step_s: list = field(default_factory=list)
    extend_step_tokens: list = field(default_factory=list)
    decode_step_s: list = field(default_factory=list)
    decode_step_bs: list = field(default_factory=list)
    # Without time_steps: when each decode pass was launched (perf_counter), so the period between
    # consecutive launches is the pipelined step (host work overlapped, as in serving).
    decode_launch_t: list = field(default_factory=list)
    gpu_idle_frac: float | None = None
    # With measure_idle: each decode pass's time on the device (ms; CUDA events around its launch), in
    # decode_step_bs's order.
    decode_device_ms: list = field(default_factory=list)
    outputs: dict = field(default_factory=dict)  # rid -> the request's final output
    ordered: list = field(default_factory=list)  # the final outputs in the prompts' order (streams merged)
    # With request={"stream": True}: per prompt, (perf_counter, tokens) of each output that carried tokens.
    token_events: list = field(default_factory=list)

    def decode_periods(self, bs: int) -> list[float]:
        """Seconds between consecutive decode launches that both ran batch size bs."""
        t, b = self.decode_launch_t, self.decode_step_bs
        return [t[i + 1] - t[i] for i in range(len(t) - 1) if b[i] == bs and b[i + 1] == bs]


def drive(engine, prompts: list[list[int]], sampling: dict, time_steps: bool = False,
          measure_idle: bool = False, request: dict | None = None) -> RunStats:
    """Submit all prompts, step the engine on this thread until every request finished. `request`: more
    GenerateRequest fields (return_logprob, stream: a streamed request's outputs are merged, and timed)."""
    from shared.models.forward_batch import ForwardMode

    finished: dict[str, object] = {}
    partial: dict[str, object] = {}
    events: dict[str, list] = {}

    def on_output(outs):
        now = time.perf_counter()
        for o in outs:
            if o.token_ids:
                events.setdefault(o.rid, []).append((now, len(o.token_ids)))
            prev = partial.pop(o.rid, None)
            whole = o if prev is None else merge_outputs(prev, o)
            if o.finished:
                finished[o.rid] = whole
            else:
                partial[o.rid] = whole
    engine.on_output = on_output
    base = f"b{time.monotonic_ns()}"
    rids = [f"{base}-{i}" for i in range(len(prompts))]
    fields = {"stream": False, **(request or {})}
    for rid, p in zip(rids, prompts):
        engine.submit(GenerateRequest(rid=rid, input_ids=p, sampling=SamplingParams(**sampling), **fields))
    stats = RunStats()
    idle_events = []
    sync()
    t0 = time.perf_counter()
    sched = engine.policy
    runner_forward = engine.runner.launch

    def timed_forward(batch):
        if measure_idle and batch.mode == ForwardMode.DECODE:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stats.decode_step_bs.append(batch.batch_size)
            stats.decode_launch_t.append(time.perf_counter())
            s.record()
            out = runner_forward(batch)
            e.record()
            idle_events.append((s, e))
            return out
        if not time_steps:
            if batch.mode == ForwardMode.EXTEND:
                stats.extend_step_tokens.append(sum(batch.extend_lens))
            else:
                stats.decode_step_bs.append(batch.batch_size)
                stats.decode_launch_t.append(time.perf_counter())
            return runner_forward(batch)
        sync()
        ts = time.perf_counter()
        out = runner_forward(batch)
        sync()
        dt = time.perf_counter() - ts
        if batch.mode == ForwardMode.EXTEND:
            stats.extend_step_s.append(dt)
            stats.extend_step_tokens.append(sum(batch.extend_lens))
        else:
            stats.decode_step_s.append(dt)
            stats.decode_step_bs.append(batch.batch_size)
        return out

    engine.runner.launch = timed_forward
    try:
        while len(finished) < len(prompts):
            engine.step()
            stats.steps += 1
    finally:
        engine.runner.launch = runner_forward
    sync()
    stats.wall_s = time.perf_counter() - t0
    stats.outputs = finished
    stats.ordered = [finished[r] for r in rids]
    stats.token_events = [events.get(r, []) for r in rids]
    for o in finished.values():
        if o.error:
            raise RuntimeError(f"request failed: {o.error}")
        stats.output_tokens += o.completion_tokens
        stats.prompt_tokens += o.prompt_tokens
        stats.cached_tokens += o.cached_tokens
    if idle_events:
        stats.decode_device_ms = [s.elapsed_time(e) for s, e in idle_events]
        busy = sum(stats.decode_device_ms)
        span = idle_events[0][0].elapsed_time(idle_events[-1][1])
        stats.gpu_idle_frac = max(0.0, 1 - busy / span) if span > 0 else None
    assert sched.is_idle()
    return stats


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of xs by rank; nan when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def graph_replay_ms(graph_runner, bs: int = 1, reps: int = 60, skip: int = 10) -> float:
    """Median time of one captured decode graph's replay: the model alone, no sampling or host work (the
    last step's inputs again, its KV writes sent to the padding slot)."""
    graph_runner.neutralize(bs)  # (a bare replay would write the last step's rows again)
    times = []
    for _ in range(reps):
        s_ev, e_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s_ev.record()
        graph_runner.graphs[bs, False].replay()
        e_ev.record()
        e_ev.synchronize()
        times.append(s_ev.elapsed_time(e_ev))
    return median(times[skip:])


GREEDY = {"temperature": 0, "ignore_eos": True}


def start_engine(ec, tok, res: dict):
    """An engine of `ec` with what its start reports recorded in res: seconds to start, the KV pool, the sizes in effect
    (derived where ec leaves them unset, shared/engine/sizing.py) and the CUDA graphs' count, capture time and memory."""
    from shared.engine.engine_loop import Engine

    t0 = time.perf_counter()
    eng = Engine(ec, tok, on_output=lambda o: None)
    c = eng.config
    res.update(engine_init_s=time.perf_counter() - t0, kv_pool_tokens=eng.runner.max_total_tokens,
               cuda_graphs=eng.runner.graph_runner is not None, graph_stats=eng.runner.graph_stats,
               sizes={k: getattr(c, k) for k in ("max_running_requests", "cuda_graph_max_bs", "chunked_prefill_size",
                                                 "max_prefill_tokens")})
    log(f"engine up in {res['engine_init_s']:.1f}s, KV pool {res['kv_pool_tokens']} tokens, sizes {res['sizes']}, "
        f"graphs {res['graph_stats'] or 'none'}")
    return eng


def engine_figures(path: str, tok, cuda: bool, vocab: int, reqs: int, steps: int, prefill: int = 0,
                   **config) -> dict:
    """An engine of `config` (dummy weights): batch-1 decode ms/step over `steps` steps, its CUDA graph's
    replay, and the output tok/s of `reqs` × (512 in, 128 out) all at once (none for reqs=0). With `prefill`
    (a prompt length, within config's max_context_len): the prefill rate of 16 such prompts in full chunked-prefill
    passes, and the time to first token of a batch-1 request whose prompt is all but its last 512 tokens a cached
    prefix (median of 8, each a new suffix). The engine is freed after."""
    import gc

    from shared.engine.config import EngineConfig
    from shared.engine.engine_loop import Engine

    ec = EngineConfig(model_path=path, load_format="dummy", cuda_graph=cuda,
                      **{"max_context_len": 4096, "max_total_tokens": 200_000, "max_running_requests": 128,
                         "cuda_graph_max_bs": 128, **config})
    eng = Engine(ec, tok, on_output=lambda o: None)
    out: dict = {}
    try:
        drive(eng, random_prompts(4, 64, vocab, 0), {**GREEDY, "max_new_tokens": 8})
        st = drive(eng, random_prompts(1, 512, vocab, 2), {**GREEDY, "max_new_tokens": steps})
        out["b1_step_ms"] = st.wall_s / max(1, st.steps) * 1e3
        periods = st.decode_periods(1)  # the decode step alone: the prompt's prefill not spread over the steps
        if periods:
            out["b1_period_ms"] = median(periods) * 1e3
            # What the run took beyond its decode steps at that period: the prompt's prefill, mostly.
            out["b1_prefill_ms"] = st.wall_s * 1e3 - st.steps * out["b1_period_ms"]
        gr = eng.runner.graph_runner
        if gr is not None:
            out["b1_graph_ms"] = graph_replay_ms(gr, reps=50)
        if reqs:
            st = drive(eng, random_prompts(reqs, 512, vocab, 5), {**GREEDY, "max_new_tokens": 128})
            out["tput_tok_s"] = st.output_tokens / st.wall_s
        if prefill:
            out.update(prefill_figures(eng, vocab, prefill))
    finally:
        eng.stop()
    del eng
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def prefill_figures(eng, vocab: int, length: int) -> dict:
    """engine_figures' prefill figures (see there), the cache emptied before and after."""
    one = {**GREEDY, "max_new_tokens": 1}
    eng.cache.reset()
    st = drive(eng, random_prompts(16, length, vocab, 30), one, time_steps=True)
    out = {"prefill_tok_s": full_pass_rate(st, eng.config.chunked_prefill_size)[0]}
    eng.cache.reset()
    prefix = random_prompts(1, length - 512, vocab, 31)[0]
    drive(eng, [prefix], one)  # cached from here on
    ttft = []
    for i, tail in enumerate(random_prompts(9, 512, vocab, 32)):
        st = drive(eng, [prefix + tail], one)
        if i:  # the first warms the extend-over-a-prefix path
            ttft.append(st.wall_s * 1e3)
        if st.cached_tokens < len(prefix):
            raise RuntimeError(f"the prefix was not reused ({st.cached_tokens} of {len(prefix)} tokens cached)")
    out["cached_prefill_ttft_ms"] = median(ttft)
    eng.cache.reset()
    return out


async def sse_events(resp):
    """The JSON events of a streamed HTTP response (aiohttp's), in order: its `data:` lines, the [DONE] sentinel
    and anything else left out."""
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])
