"""JSON-extraction workload with schema-heavy output: jump-forward vs token-by-token constrained vs
unconstrained decoding through the real engine, and the grammar mask cost per token at batch 32: the
fill on its own (host fill + copy + unpack, nothing to hide behind) and what of it stays on the critical
path in the engine, where the host fills a step's masks while the device runs that step's forward.

    python -m bench.structured [--shape llama-3.1-8b|tiny|tiny-wide] [--num-reqs 64] [--modes ...] [--out DIR]

Goals: jump-forward >= 2x token-by-token constrained decoding; the grammar mask <= 40 us a token on the critical
path at batch 32. Writes structured.json to --out.

Random weights: what the model writes inside free fields is noise, but the grammar's forced scaffolding
(keys, punctuation, enum tails) is the same as with a real model, and that is what jump-forward skips.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.common import SHAPES, drive, log, median, model_dir, sync
from shared.engine.config import EngineConfig
from shared.engine.engine_loop import Engine
from shared.tokenizer import Tokenizer

# Extraction-style schema: many fixed keys, enums, bounded numbers, short strings.
SCHEMA = {
    "type": "object",
    "properties": {
        "customer_name": {"type": "string", "maxLength": 6},
        "customer_status": {"enum": ["active_subscriber", "inactive_subscriber", "trial_period_user"]},
        "account_identifier": {"type": "integer", "minimum": 0, "maximum": 999},
        "shipping_address_country": {"enum": ["United States of America", "United Kingdom", "Germany"]},
        "order_priority_level": {"enum": ["standard_delivery", "express_delivery", "overnight_delivery"]},
        "is_returning_customer": {"type": "boolean"},
        "preferred_contact_method": {"enum": ["electronic_mail", "telephone_call", "postal_mail"]},
        "loyalty_program_tier": {"enum": ["bronze_member", "silver_member", "gold_member"]},
    },
    "required": ["customer_name", "customer_status", "account_identifier", "shipping_address_country",
                 "order_priority_level", "is_returning_customer", "preferred_contact_method",
                 "loyalty_program_tier"],
    "additionalProperties": False,
}


GOAL_JF_SPEEDUP = 2.0  # issue 14: jump-forward >= 2x token-by-token constrained decoding
GOAL_MASK_US = 40.0  # issue 14: grammar mask on the critical path, us per token at batch 32


def mask_cost_us_per_token(eng, batch: int, steps: int = 200) -> float:
    """Fill + device transfer + bool conversion of the batch mask, per token, along real decoding paths."""
    states = [eng.grammars.state_for("json_schema", json.dumps(SCHEMA)) for _ in range(batch)]
    masker = eng.runner.masker
    dev = eng.runner.device
    times = []
    for step in range(steps):
        sync()
        t0 = time.perf_counter()
        mask = masker.build(states, device=dev)
        allowed = mask.to_bool()
        sync()
        times.append(time.perf_counter() - t0)
        # Advance every state along an allowed token (the first allowed id), restarting finished ones.
        first = allowed.float().argmax(dim=-1).tolist()
        for i, st in enumerate(states):
            if st.is_terminated() or not st.accept_token(first[i]):
                states[i] = eng.grammars.state_for("json_schema", json.dumps(SCHEMA))
    return median(times[20:]) / batch * 1e6


def mask_exposed_us_per_token(eng, prompts: list[list[int]], sampling: dict, batch: int = 32) -> dict:
    """Token-by-token constrained decoding of `batch` requests through the engine (every step masks
    every row), with the runner's mask timing on. Per masked token: `exposed_us`, the time from the
    later of (forward done, fill start) to the mask being ready on the device, i.e. what the masks
    added to the step; `host_fill_us`, the host's fill time, hidden or not."""
    runner = eng.runner
    eng.cache.reset()
    runner.mask_timing = []
    try:
        drive(eng, prompts[:batch], sampling)
        sync()
        records, runner.mask_timing = runner.mask_timing, None
    finally:
        runner.mask_timing = None
    rows = sum(r[2] for r in records)
    exposed = sum((e - s) if isinstance(s, float) else s.elapsed_time(e) / 1e3 for s, e, _, _ in records)
    host = sum(r[3] for r in records)
    return {"steps": len(records), "masked_tokens": rows, "exposed_us": exposed / max(1, rows) * 1e6,
            "host_fill_us": host / max(1, rows) * 1e6}


def main():
    ap = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--num-reqs", type=int, default=64)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    ap.add_argument("--modes", default="jump-forward,jump-fwd verify,token-by-token,unconstrained",
                    help="comma-separated subset of the modes to time")
    ap.add_argument("--no-mask-cost", action="store_true", help="skip the batch-32 mask cost figures")
    args = ap.parse_args()
    wanted = set(args.modes.split(","))
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    path = model_dir(args.shape)
    tok = Tokenizer.load(path)
    ec = EngineConfig(model_path=path, load_format="dummy", max_context_len=4096, max_running_requests=256,
                      cuda_graph=cuda)
    eng = Engine(ec, tok, on_output=lambda o: None)
    eng_nojf = Engine(EngineConfig(**{**ec.__dict__, "disable_jump_forward": True}), tok,
                      on_output=lambda o: None, runner=eng.runner)
    eng_verify = Engine(EngineConfig(**{**ec.__dict__, "jump_forward_mode": "verify"}), tok,
                        on_output=lambda o: None, runner=eng.runner)
    prompts = [tok.encode(f"Record {i}: extract the customer fields as JSON.\n") for i in range(args.num_reqs)]
    schema = json.dumps(SCHEMA)
    constrained = {"json_schema": schema, "temperature": 0, "max_new_tokens": 512}
    log("warm-up")
    drive(eng, prompts[:4], constrained)
    drive(eng_nojf, prompts[:4], constrained)
    drive(eng_verify, prompts[:4], constrained)
    drive(eng, prompts[:4], {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": torch.cuda.get_device_name() if cuda else "cpu",
           "num_reqs": args.num_reqs}
    modes = [("jump-forward", eng, constrained), ("jump-fwd verify", eng_verify, constrained),
             ("token-by-token", eng_nojf, constrained)]
    for name, engine, sampling in modes:
        if name not in wanted:
            continue
        engine.cache.reset()
        jf0, steps0 = engine.jump_forward_tokens, engine.steps
        st = drive(engine, prompts, sampling)
        res[name] = {"wall_s": st.wall_s, "output_tokens": st.output_tokens, "steps": engine.steps - steps0,
                     "req_per_s": len(prompts) / st.wall_s, "jump_tokens": engine.jump_forward_tokens - jf0,
                     "extend_steps": len(st.extend_step_tokens), "extend_tokens": sum(st.extend_step_tokens),
                     "decode_steps": len(st.decode_step_bs)}
        log(f"{name}: {st.wall_s:.2f}s, {st.output_tokens} tokens, {engine.steps - steps0} steps "
            f"({len(st.extend_step_tokens)} extend with {sum(st.extend_step_tokens)} tokens, "
            f"{len(st.decode_step_bs)} decode)")
    if "unconstrained" in wanted:
        # Unconstrained: the same number of output tokens per request, no grammar.
        per_req = max(1, res["token-by-token"]["output_tokens"] // len(prompts)) if "token-by-token" in res else 254
        eng.cache.reset()
        st = drive(eng, prompts, {"temperature": 0, "max_new_tokens": per_req, "ignore_eos": True})
        res["unconstrained"] = {"wall_s": st.wall_s, "output_tokens": st.output_tokens,
                                "req_per_s": len(prompts) / st.wall_s}
        log(f"unconstrained: {st.wall_s:.2f}s")
    if not args.no_mask_cost:
        res["mask_us_per_token_b32"] = mask_cost_us_per_token(eng, 32)
        res["mask_in_engine_b32"] = mask_exposed_us_per_token(eng_nojf, prompts, constrained, 32)
    if "token-by-token" in res and "jump-forward" in res:
        res["jump_forward_speedup"] = res["token-by-token"]["wall_s"] / res["jump-forward"]["wall_s"]
    with open(os.path.join(args.out, "structured.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(f"\n{res['gpu']}  {args.num_reqs} JSON extractions, schema with {len(SCHEMA['properties'])} fields")
    print(f"{'mode':18s} {'wall s':>8s} {'req/s':>8s} {'tokens':>8s} {'ms/token':>9s} {'steps':>6s}")
    for name in ("jump-forward", "jump-fwd verify", "token-by-token", "unconstrained"):
        if name not in res:
            continue
        r = res[name]
        print(f"{name:18s} {r['wall_s']:8.2f} {r['req_per_s']:8.2f} {r['output_tokens']:8d} "
              f"{1e3 * r['wall_s'] / max(1, r['output_tokens']) * args.num_reqs:9.2f} {r.get('steps', 0):6d}")
    verdicts = []
    if "jump_forward_speedup" in res:
        print(f"jump-forward speedup {res['jump_forward_speedup']:.2f}x (goal 2x)")
        verdicts.append(f"{'PASS' if res['jump_forward_speedup'] >= GOAL_JF_SPEEDUP else 'FAIL'}  jump-forward "
                        f"{res['jump_forward_speedup']:.2f}x token-by-token (goal >= {GOAL_JF_SPEEDUP})")
    if "mask_in_engine_b32" in res:
        m = res["mask_in_engine_b32"]
        print(f"mask fill alone {res['mask_us_per_token_b32']:.1f} us/token at batch 32; in the engine "
              f"{m['exposed_us']:.1f} us/token on the critical path (goal 40), host fill {m['host_fill_us']:.1f} "
              f"us/token ({m['steps']} steps, {m['masked_tokens']} masked tokens)")
        verdicts.append(f"{'PASS' if m['exposed_us'] <= GOAL_MASK_US else 'FAIL'}  grammar mask {m['exposed_us']:.1f} "
                        f"us/token on the critical path at batch 32 (goal <= {GOAL_MASK_US:g})")
    if verdicts:
        print()
        print("\n".join(verdicts))


if __name__ == "__main__":
    main()
