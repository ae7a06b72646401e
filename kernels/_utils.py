"""Small helpers the Triton kernels share: launch sizing and dtype-dependent choices."""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def interpreting() -> bool:
    """True when Triton runs kernels in its numpy interpreter (CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(device: torch.device | str) -> bool:
    """Triton kernels can run on this device: a GPU, or the CPU under the interpreter."""
    return torch.device(device).type == "cuda" or interpreting()


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None = None) -> int:
    """Multiprocessor count; a fixed small number on CPU so interpreted launches stay cheap."""
    if not torch.cuda.is_available():
        return 4
    idx = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(idx).multi_processor_count


_CONFIGS = Path(__file__).resolve().parent / "configs"
DEVICE_KEYS = ("H100", "H200")  # the GPUs a tile table may be keyed by (a substring of the device's name)


@functools.lru_cache(maxsize=None)
def device_key() -> str:
    """The GPU's key in the tile tables: one of DEVICE_KEYS where its name contains it, else "fallback" (one kind of
    GPU a process: asked once)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((k for k in DEVICE_KEYS if k in name), "fallback")


@functools.lru_cache(maxsize=None)
def _tile_table(kernel: str, table: str, device: str) -> dict[tuple[int, ...], tuple[int, ...]]:
    data = json.loads((_CONFIGS / f"{kernel}.json").read_text())
    section = data.get(device, {}).get(table) or data["fallback"][table]
    return {tuple(int(v) for v in shape.split("x")): tuple(tile) for shape, tile in section["tiles"].items()}


def tile_table(kernel: str, table: str) -> dict[tuple[int, ...], tuple[int, ...]]:
    """A kernel's tuned tiles by shape (kernels/configs/<kernel>.json: "NxK" keys, tile lists) for the current GPU: its
    own table where the file has one under its device_key, else the "fallback" one. Read once a process (one object:
    a test may patch an entry and put it back)."""
    return _tile_table(kernel, table, device_key())


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise run as tf32 on tensor cores and miss fp32 tolerances.
    return "ieee" if dtype == torch.float32 else "tf32"



_pdl_default = False
_pdl_early: frozenset[str] = frozenset()
PDL_FAMILIES = ("attention", "norm", "rope", "gemv")


def set_pdl(enabled: bool, early_trigger: str | bool = "") -> None:
    """The process's choice for kernels launched without an explicit `pdl` (the engine sets it once, from
    its config, before capturing CUDA graphs). early_trigger: the kernel families (names of PDL_FAMILIES
    separated by "," or "+", or True for all) that let the next kernel launch before they wait (pdl_launch)."""
    global _pdl_default, _pdl_early
    early = parse_pdl_families(early_trigger)
    _pdl_default, _pdl_early = bool(enabled), early


def pdl_early_families() -> frozenset[str]:
    """The kernel families set_pdl lets trigger the next launch before their wait."""
    return _pdl_early


def parse_pdl_families(text: str | bool) -> frozenset[str]:
    if text is True:
        return frozenset(PDL_FAMILIES)
    names = frozenset(n.strip() for n in (text or "").replace("+", ",").split(",") if n.strip())
    unknown = names - set(PDL_FAMILIES)
    if unknown:
        raise ValueError(f"unknown kernel families {sorted(unknown)}; choose from {', '.join(PDL_FAMILIES)}")
    return names


def pdl_launch(enabled: bool | None = None, family: str = "") -> dict:
    """Launch options for a kernel compiled with a `PDL` constexpr: {PDL, launch_pdl} where programmatic
    dependent launch is asked for (explicitly, or by set_pdl) and possible (compute capability >= 9, not
    the interpreter). Such a kernel calls griddepcontrol.wait before it reads anything an earlier kernel
    wrote (and before any early exit), so it may be scheduled while the previous grid drains: in a CUDA
    graph a kernel boundary stops costing a launch gap, and a GEMV starts streaming its weights early.

    PDL is 1 (True) or 2. At 1 a kernel lets the next one launch once it has waited for the previous one;
    at 2 (early trigger, for set_pdl's families) before it waits, so the kernel after it can
    be resident sooner: after the two decode-attention stages, the o_proj GEMV streams its first weight
    tiles under both, not just the second. Either way a kernel's writes happen after its wait, so a kernel
    that completes has seen every earlier kernel complete: what a later one reads is written."""
    on = (_pdl_default if enabled is None else bool(enabled)) and pdl_supported()
    if not on:
        return {"PDL": False}
    return {"PDL": 2 if family in _pdl_early else True, "launch_pdl": True}


@functools.lru_cache(maxsize=None)
def pdl_supported() -> bool:
    return (not interpreting() and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)


@triton.jit
def pdl_trigger_early(PDL: tl.constexpr):
    """For a kernel with work to do before its wait (a GEMV's first weight tiles): its first statement, so
    that with PDL == 2 the next kernel may launch at once; then pdl_prologue(PDL, True) before the first
    read of an earlier kernel's output."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_prologue(PDL: tl.constexpr, TRIGGERED: tl.constexpr = False):
    """Before a kernel's first read of an earlier kernel's output, and unconditional (no program may exit
    before it), so completion stays transitive: wait for the previous grid's writes and let the next kernel
    launch (PDL == 1: after the wait; PDL == 2: before it, unless pdl_trigger_early already did)."""
    if PDL == 2:
        if not TRIGGERED:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """pdl_prologue's wait alone, for a kernel that lets the next one launch later (pdl_trigger), not at once."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
