"""Command-line flags of the engine, generated from EngineConfig so the two never drift apart."""
from __future__ import annotations

import argparse
import dataclasses
import re

from shared.engine.config import EngineConfig

_CHOICES = {
    "dtype": ["auto", "float32", "bfloat16", "float16"],
    "attention_backend": ["auto", "torch", "triton", "flashinfer"],
    "schedule_policy": ["lpm", "fcfs"],
    "load_format": ["auto", "dummy"],
    "quantization": ["none", "fp8"],
    "jump_forward_mode": ["retokenize", "verify"],
    "kv_transfer_staging": ["device", "host"],
}


def _device(value: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: use auto, cpu, cuda or cuda:N")
    return value


_TYPES = {"device": _device}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            if f.default:
                parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                    help=f"disable {f.name}")
                parser.set_defaults(**{f.name: True})
            else:
                parser.add_argument(flag, dest=f.name, action="store_true")
            continue
        typ = _TYPES.get(f.name) or next(
            (t for t in (int, float) if f.type is t or str(f.type).startswith(t.__name__)), str)
        parser.add_argument(flag, dest=f.name, type=typ, default=f.default, choices=_CHOICES.get(f.name))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def engine_args_to_argv(args: argparse.Namespace) -> list[str]:
    """The flags that differ from the defaults, to pass a config on to a child process."""
    argv: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name)
        if value == f.default:
            continue
        name = f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{name}" if value else f"--no-{name}")
        else:
            argv += [f"--{name}", str(value)]
    return argv
