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


def test_b1_variants_take_engine_fields_and_module_knobs():
    """bench.b1 --variants: EngineConfig fields, and @module.NAME knobs set only while their variant runs."""
    import kernels.gemv as kg
    from bench.b1 import module_knobs, parse_variants
    v = parse_variants("base=;late=@kernels.gemv.PRODUCER_LATE_TRIGGER=1,decode_norm_fusion=0")
    assert v == {"base": {}, "late": {"@kernels.gemv.PRODUCER_LATE_TRIGGER": True, "decode_norm_fusion": False}}
    assert kg.PRODUCER_LATE_TRIGGER is False
    with module_knobs({"kernels.gemv.PRODUCER_LATE_TRIGGER": True}):
        assert kg.PRODUCER_LATE_TRIGGER is True
    assert kg.PRODUCER_LATE_TRIGGER is False
    # A variant's own quantization (bf16 beside FP8 variants in one A/B) overrides --quantization.
    from bench.b1 import engine_fields
    v = parse_variants("bf16=quantization=none;fp8=;knob=@kernels.gemv.FP8_PACKED=1,decode_norm_fusion=0")
    assert engine_fields("fp8", v["bf16"]) == {} and engine_fields("fp8", v["fp8"]) == {"quantization": "fp8"}
    assert engine_fields("none", v["knob"]) == {"decode_norm_fusion": False}
    for bad in ("x=@kernels.gemv.NO_SUCH=1", "x=@no_such_module.X=1", "x=no_such_field=1"):
        with pytest.raises(SystemExit):
            parse_variants(bad)
