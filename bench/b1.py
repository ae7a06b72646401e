"""Batch-1 decode alone, for A/B runs of a change to the decode path: the engine's step (wall, overlap on)
and its CUDA graph's replay, Llama-3.1-8B shape with dummy weights, bf16 and/or FP8, each in a fresh
engine. One JSON line per engine, so a shell loop can alternate code versions between processes.

    python -m bench.b1 [--quantization none,fp8] [--steps 400] [--label NAME]
    python -m bench.b1 --variants "base=;early=pdl_early_trigger=1" --rounds 2

--variants A/Bs engine settings in one process: NAME=FIELD=VALUE,... entries separated by ";", each an
engine of those EngineConfig fields, alternated --rounds times (values parsed as Python literals where
they parse, "1"/"0" as booleans for boolean fields). A FIELD of the form @module.NAME is a module-level knob
instead (e.g. @kernels.gemv.PRODUCER_LATE_TRIGGER=1), set while that variant's engine is built and run.

The figures are bench.offline's and bench.fp8's batch-1 figures (same drive, same replay timing) without
their throughput runs; the floor and the goals stay theirs.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json

from bench.common import engine_figures, log, model_dir
from shared.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="none", help="comma-separated: none, fp8")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--label", default="")
    ap.add_argument("--variants", default="", help='"NAME=FIELD=VALUE,...;NAME2=..." engine settings to alternate')
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    path = model_dir("llama-3.1-8b")
    tok = Tokenizer.load(path)
    variants = parse_variants(args.variants) if args.variants else {args.label: {}}
    for r in range(args.rounds):
        for name, settings in variants.items():
            for q in args.quantization.split(","):
                fields = engine_fields(q, settings)
                q = fields.get("quantization", "none")
                with module_knobs({k[1:]: v for k, v in settings.items() if k.startswith("@")}):
                    fig = engine_figures(path, tok, True, 400, 0, args.steps, max_running_requests=8,
                                         cuda_graph_max_bs=8, **fields)
                log(f"{name} {q} round {r + 1}: step {fig['b1_step_ms']:.3f} ms, "
                    f"replay {fig.get('b1_graph_ms', 0):.3f} ms, decode alone {fig.get('b1_period_ms', 0):.3f} ms, "
                    f"prefill ~{fig.get('b1_prefill_ms', 0):.1f} ms")
                print(json.dumps({"label": name, "round": r + 1, "quantization": q, "settings": settings, **fig}),
                      flush=True)


def engine_fields(quantization: str, settings: dict) -> dict:
    """A variant's EngineConfig fields (its @module knobs left out) at --quantization `quantization`, which the
    variant's own quantization (e.g. "bf16=quantization=none") overrides; "none" is the default's (no field)."""
    fields = {"quantization": quantization, **{k: v for k, v in settings.items() if not k.startswith("@")}}
    if fields["quantization"] == "none":
        del fields["quantization"]
    return fields


@contextlib.contextmanager
def module_knobs(knobs: dict):
    """{"package.module.NAME": value}: each module attribute set for the block, then restored."""
    saved = []
    try:
        for dotted, value in knobs.items():
            mod, _, name = dotted.rpartition(".")
            module = importlib.import_module(mod)
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def parse_variants(text: str) -> dict[str, dict]:
    """"base=;early=pdl_early_trigger=1,max_kv_splits=32" -> {"base": {}, "early": {...}}."""
    import dataclasses

    from shared.engine.config import EngineConfig
    types = {f.name: f.type for f in dataclasses.fields(EngineConfig)}
    out: dict[str, dict] = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        name, _, rest = entry.partition("=")
        settings = {}
        for item in filter(None, (i.strip() for i in rest.split(","))):
            key, _, value = item.partition("=")
            if key.startswith("@"):
                mod, _, attr = key[1:].rpartition(".")
                try:
                    default = getattr(importlib.import_module(mod), attr)
                except (ImportError, AttributeError, ValueError):
                    raise SystemExit(f"--variants: {key[1:]!r} is not a module attribute") from None
                is_bool = isinstance(default, bool)
            elif key in types:
                is_bool = types[key] in (bool, "bool")
            else:
                raise SystemExit(f"--variants: {key!r} is not an EngineConfig field")
            settings[key] = _parse_value(value, is_bool)
        out[name] = settings
    return out


def _parse_value(value: str, is_bool: bool):
    """"1"/"true"/"yes" for booleans; otherwise a Python literal where it parses, else the string."""
    import ast

    if is_bool:
        return value.lower() in ("1", "true", "yes")
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value

if __name__ == "__main__":
    main()
