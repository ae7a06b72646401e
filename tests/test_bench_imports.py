"""Every bench/ script imports on a CPU machine: a helper renamed in one module must not leave another
script broken until someone runs it on the GPU (bench/pd_idle_cpu.py imported a name bench/pd.py no
longer had)."""
import importlib
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__"))
def test_bench_module_imports(name):
    importlib.import_module(f"bench.{name}")
