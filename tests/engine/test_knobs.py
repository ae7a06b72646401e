"""shared/knobs.py: every tunable declared once, read from RADIXSERVE_<NAME>, checked, listed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared import knobs

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_without_the_environment(monkeypatch):
    for name in knobs.KNOBS:
        monkeypatch.delenv(knobs.PREFIX + name, raising=False)
    assert all(knobs.knob(k.name) == k.default and type(k.default) is k.type for k in knobs.KNOBS.values())


@pytest.mark.parametrize("name,text,value", [
    ("SPLIT_K_MIN_PROGRAMS", "1.5", 1.5), ("GEMV_MAX_M", "8", 8), ("GATEWAY_YOUNG_THRESHOLD", "20_000", 20000),
    ("COMPILE_ON_CUDA", "0", False), ("COMPILE_ON_CUDA", "Off", False), ("COMPILE_ON_CUDA", "yes", True),
    ("GEMV_MAX_M", "", 16)])
def test_values_parse_as_the_knobs_type(monkeypatch, name, text, value):
    monkeypatch.setenv("RADIXSERVE_" + name, text)
    got = knobs.knob(name)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("name,text", [("GEMV_MAX_M", "1.5"), ("GEMV_MAX_M", "many"), ("COMPILE_ON_CUDA", "2"),
                                       ("SPLIT_K_MIN_PROGRAMS", "two")])
def test_a_bad_value_names_the_variable(monkeypatch, name, text):
    monkeypatch.setenv("RADIXSERVE_" + name, text)
    with pytest.raises(knobs.KnobError, match=f"RADIXSERVE_{name}={text!r}: expected"):
        knobs.knob(name)


def test_every_knob_is_read_by_the_module_it_names():
    """The declared module holds a constant of the knob's name, set from the environment when it is imported."""
    modules = sorted({k.module for k in knobs.KNOBS.values()})
    code = ("import importlib, json, sys; from shared import knobs; "
            "print(json.dumps({k.name: getattr(importlib.import_module(k.module), k.name) for k in knobs.KNOBS.values()}))")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RADIXSERVE_SPLIT_K_MIN_PROGRAMS="3.25", RADIXSERVE_LONG_REQS="7", RADIXSERVE_COMPILE_ON_CUDA="off")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    values = json.loads(r.stdout.splitlines()[-1])
    changed = {"SPLIT_K_MIN_PROGRAMS": 3.25, "LONG_REQS": 7, "COMPILE_ON_CUDA": False}
    assert values == {n: changed.get(n, k.default) for n, k in knobs.KNOBS.items()}, modules


def test_the_listing_shows_values_and_flags_unknown_names():
    env = dict(os.environ, RADIXSERVE_PROGRAMS_PER_SM="8", RADIXSERVE_NEW_KV_TMA="0",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "shared.knobs"], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()[1:]}
    assert set(rows) == {"RADIXSERVE_" + n for n in knobs.KNOBS}
    assert rows["RADIXSERVE_PROGRAMS_PER_SM"][1:4] == ["int", "4", "8"]
    assert "RADIXSERVE_NEW_KV_TMA is set but names no knob" in r.stderr
    bad = subprocess.run([sys.executable, "-m", "shared.knobs"], env=dict(env, RADIXSERVE_LONG_REQS="four"), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "RADIXSERVE_LONG_REQS='four': expected an integer" in bad.stderr


def test_unknown_variables_spare_the_other_settings():
    env = {"RADIXSERVE_INTERNAL_KEY": "k", "RADIXSERVE_EVENT_LOOP": "asyncio", "RADIXSERVE_GEMV_MAX_M": "4",
           "RADIXSERVE_HEAD_MAJOR": "1", "PATH": "/bin"}
    assert knobs.unknown_variables(env) == ["RADIXSERVE_HEAD_MAJOR"]
