"""Why jump-forward can cost time on the JSON workload: its requests run through the engine directly, with
P in flight (a new one as one finishes, as the workload driver's --parallel does), with and without
jump-forward, counting what each mode makes the engine do.

    python -m bench.workloads.jump_forward_probe [--shape tiny] [--programs 48] [--parallel 16]

Counted per mode: engine steps; decode passes (the CUDA-graph eligible ones on a GPU) and extend passes,
split into those that admit a new prompt and pure catch-up passes that exist only because some running
request jumped (its forced tokens need KV); forced runs found (with their lengths in tokens), jumps declined
by --jump-forward-threshold, and forced tokens jumped; retokenizations (the tokenizer encodes the boundary
once per forced run found); output tokens; wall time and mean step time per pass kind. Random weights, greedy, the workload's regex and
prompts (bench/workloads/programs.py); forced text is the same as with a real model.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from bench.common import SHAPES, model_dir
from bench.workloads.programs import CITY_REGEX, make_json
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.forward_batch import ForwardMode
from shared.protocol import FinishLength, GenerateRequest
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

HEAD = ("Please extract the information of a city from the following wikipedia page.\n"
        "Page begin.\n{document}\nPage end.\nHere is the name, country, and symbol of the city in JSON format.\n")


def prompts(tok: Tokenizer, n: int, scale: float, seed: int) -> list[list[int]]:
    return [tok.encode(HEAD.format(**kw)) for kw in make_json(n, scale, seed)]


def run(engine: Engine, reqs: list[list[int]], parallel: int, sampling: dict, stagger: int = 0) -> dict:
    """Keep `parallel` requests in flight until all are done (a new one as soon as one finishes); the first
    `parallel` are admitted one every `stagger` engine steps, so their forced runs fall on different steps,
    as in a running workload, not in lockstep. Count passes by kind."""
    import importlib

    import shared.engine.engine as engine_mod

    jf_mod = importlib.import_module("shared.constrained.jump_forward")  # the package re-exports a function

    done: dict[str, object] = {}
    texts: dict[str, str] = {}

    def on_output(outs):
        for o in outs:
            texts[o.rid] = texts.get(o.rid, "") + o.text
            if o.finished:
                done[o.rid] = o
    engine.on_output = on_output
    counts = {"steps": 0, "decode_passes": 0, "decode_bs": 0, "extend_admit_passes": 0, "extend_catchup_passes": 0,
              "extend_tokens": 0, "forced_runs": 0, "retokenizations": 0, "jump_lengths": [],
              "settle_ms": 0.0}
    declined0 = engine.jump_forward_declined
    launch = engine.runner.launch

    kind = [None]

    def counted_launch(batch):
        if batch.mode == ForwardMode.DECODE:
            kind[0] = "decode"
            counts["decode_bs"] += batch.batch_size
        else:
            # A pass in which no request starts (all were already running) exists only to catch up.
            admits = any(r.num_resolved == 0 and not r.output_ids[:-1] for r in batch.reqs)
            kind[0] = "extend_admit" if admits else "extend_catchup"
            counts["extend_tokens"] += sum(batch.extend_lens)
        counts[kind[0] + "_passes"] += 1
        return launch(batch)

    real_jf, real_retok, real_settle = engine_mod.plan_jump, jf_mod._retokenize, engine._settle_jumps

    def counted_jf(*a, **kw):
        out = real_jf(*a, **kw)
        if out is not None:
            counts["forced_runs"] += 1
            counts["jump_lengths"].append(len(out.new_ids))
        return out

    def counted_retok(*a, **kw):
        counts["retokenizations"] += 1
        return real_retok(*a, **kw)

    def timed_settle():
        t = time.perf_counter()
        real_settle()
        counts["settle_ms"] += 1e3 * (time.perf_counter() - t)

    engine.runner.launch, engine_mod.plan_jump, jf_mod._retokenize = counted_launch, counted_jf, counted_retok
    engine._settle_jumps = timed_settle
    jf0, gen0 = engine.jump_forward_tokens, engine.generated_tokens
    step_s = {"decode": 0.0, "extend_admit": 0.0, "extend_catchup": 0.0}
    base = f"p{time.monotonic_ns()}"
    submitted = 0
    t0 = time.perf_counter()
    try:
        last_submit = -stagger
        while len(done) < len(reqs):
            while (submitted < len(reqs) and submitted - len(done) < parallel
                   and (submitted >= parallel or counts["steps"] - last_submit >= stagger)):
                engine.submit(GenerateRequest(rid=f"{base}-{submitted}", input_ids=reqs[submitted],
                                              sampling=SamplingParams(**sampling), stream=False))
                submitted += 1
                last_submit = counts["steps"]
            kind[0] = None
            t = time.perf_counter()
            engine.step()
            if kind[0] is not None:  # the step launching this pass (it processes the previous one too)
                step_s[kind[0]] += time.perf_counter() - t
            counts["steps"] += 1
    finally:
        engine.runner.launch, engine_mod.plan_jump, jf_mod._retokenize = launch, real_jf, real_retok
        del engine._settle_jumps
    wall = time.perf_counter() - t0
    errors = [o.error for o in done.values() if o.error]
    if errors:
        raise RuntimeError(f"request failed: {errors[0]}")
    counts.update(wall_s=round(wall, 3), programs_per_s=round(len(reqs) / wall, 2),
                  forced_tokens=engine.jump_forward_tokens - jf0,
                  jumps_declined=engine.jump_forward_declined - declined0, sampled_tokens=engine.generated_tokens - gen0,
                  output_tokens=sum(o.completion_tokens for o in done.values()),
                  finished_by_length=sum(isinstance(o.finish_reason, FinishLength) for o in done.values()))
    counts["mean_decode_bs"] = round(counts["decode_bs"] / max(1, counts["decode_passes"]), 2)
    # Host time spent deciding and making jumps (planning, tokenizing, matcher moves), per engine step.
    counts["settle_ms_per_step"] = round(counts.pop("settle_ms") / max(1, counts["steps"]), 3)
    for k, total in step_s.items():  # mean wall time of a step that ran a pass of this kind
        counts[f"{k}_step_ms"] = round(1e3 * total / counts[f"{k}_passes"], 2) if counts[f"{k}_passes"] else None
    lengths = sorted(counts.pop("jump_lengths"))
    counts["jump_length_median"] = lengths[len(lengths) // 2] if lengths else 0
    counts["jump_length_quartiles"] = [lengths[len(lengths) * q // 4] for q in (1, 2, 3)] if lengths else []
    counts["sample_output"] = next(iter(texts.values()))[:200]
    return counts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.workloads.jump_forward_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="model shape (random weights)")
    ap.add_argument("--programs", type=int, default=48, help="JSON requests per mode")
    ap.add_argument("--parallel", type=int, default=16, help="requests in flight")
    ap.add_argument("--scale", type=float, default=1.0, help="document length scale (as the workload's --scale)")
    ap.add_argument("--seed", type=int, default=0, help="data seed")
    ap.add_argument("--stagger", type=int, default=8,
                    help="engine steps between two of the first --parallel submissions (0: all at once); spreads "
                         "the requests' forced runs over different steps as in a running workload")
    ap.add_argument("--thresholds", default="0,3",
                    help="comma-separated --jump-forward-threshold values to run with jump-forward on "
                         "(0: every forced run is jumped, as before the threshold existed)")
    ap.add_argument("--grammar", default="workload", choices=["workload", "structured"],
                    help="workload: the JSON workload's regex and prompts; structured: bench/structured.py's schema")
    ap.add_argument("--out", default=None, help="write the counts here as JSON")
    args = ap.parse_args(argv)
    path = model_dir(args.shape)
    tok = Tokenizer.load(path)
    cfg = EngineConfig(model_path=path, load_format="dummy", max_context_len=4096, max_running_requests=256)
    off = Engine(EngineConfig(**{**cfg.__dict__, "disable_jump_forward": True}), tok, on_output=lambda o: None)
    modes = [("jump-forward off", off)]
    for t in [float(x) for x in args.thresholds.split(",")]:
        modes.append((f"jump-forward on, threshold {t:g}",
                      Engine(EngineConfig(**{**cfg.__dict__, "jump_forward_threshold": t}), tok,
                             on_output=lambda o: None, runner=off.runner)))
    sampling = {"regex": CITY_REGEX, "max_new_tokens": 128, "temperature": 0}
    reqs = prompts(tok, args.programs, args.scale, args.seed)
    warm = prompts(tok, 4, args.scale, args.seed + 1)
    if args.grammar == "structured":
        from bench.structured import SCHEMA
        sampling = {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 512, "temperature": 0}
        reqs = [tok.encode(f"Record {i}: extract the customer fields as JSON.\n") for i in range(args.programs)]
        warm = reqs[:4]
    results = {}
    for name, engine in modes:
        run(engine, warm, args.parallel, sampling)  # grammar compile and first shapes, untimed
        engine.cache.reset()
        results[name] = run(engine, reqs, args.parallel, sampling, args.stagger)
        print(name, json.dumps(results[name]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
