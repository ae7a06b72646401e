"""Every bench/ script imports on a CPU machine: a helper renamed in one module must not leave another
script broken until someone runs it on the GPU (bench/pd_idle_cpu.py imported a name bench/pd.py no
longer had)."""
import importlib
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


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
    v = parse_variants("bf16=quantization=none;fp8=;knob=@kernels.gemv.SPLITK_TICKETS=0,decode_norm_fusion=0")
    assert engine_fields("fp8", v["bf16"]) == {} and engine_fields("fp8", v["fp8"]) == {"quantization": "fp8"}
    assert engine_fields("none", v["knob"]) == {"decode_norm_fusion": False}
    for bad in ("x=@kernels.gemv.NO_SUCH=1", "x=@no_such_module.X=1", "x=no_such_field=1"):
        with pytest.raises(SystemExit):
            parse_variants(bad)


def test_gemv_chain_sweep_keeps_each_shapes_fastest_tile_and_skips_the_base(capsys):
    """bench.gemv_chain_sweep's shape-by-shape sweep (every study uses it): one shape varied at a time, a tile that
    fails to compile skipped, the base never re-timed, a shape whose candidates all lose keeps its base tile."""
    from bench.gemv_chain_sweep import SHAPES, sweep_shapes
    from kernels.gemv import GemvConfig

    base = {nm: GemvConfig(8, 512, 1, 4) for nm in SHAPES}
    timed = []

    def time_us(cfgs):
        varied = [nm for nm in SHAPES if cfgs[nm] != base[nm]]
        assert len(varied) == 1
        cfg = cfgs[varied[0]]
        timed.append((varied[0], cfg.block_n))
        if cfg.block_n == 32:
            raise RuntimeError("out of resources")
        return 100.0 - cfg.block_n if varied[0] != "down" else 200.0

    def cands(name, n, k):
        return [GemvConfig(bn, 512, 1, 4) for bn in (8, 16, 32, 4)]
    picks, rows = sweep_shapes(time_us, base, 100.0, cands, share=60.0)
    assert picks["qkv"] == GemvConfig(16, 512, 1, 4) and picks["down"] == base["down"]
    assert ("qkv", 8) not in timed and ("qkv", 32) in timed
    assert len(rows) == 2 * len(SHAPES)  # 16 and 4 a shape: the base skipped, the failure not a row
    assert "RuntimeError" in capsys.readouterr().out


def test_gemv_chain_sweep_alternate_then_sweep_on_a_fake_chain(monkeypatch, capsys):
    """The studies' common driver (bench.gemv_chain_sweep.alternate_then_sweep), end to end on the CPU with the
    chain timed by a stand-in: each named tile set alternated twice, every shape's candidates tried from the base set,
    and the picks (the fastest candidate of each shape) alternated twice against every set."""
    import torch

    import bench.gemv_chain_sweep as cs
    from kernels.gemv import GemvConfig

    layers = [{nm: (torch.zeros(1, dtype=torch.uint8), None) for nm in cs.SHAPES}]
    seen = []

    def chain_ms(layers, cfgs):
        seen.append({nm: c.block_k for nm, c in cfgs.items()})
        return 1.0 - 0.001 * sum(c.block_k for c in cfgs.values()) / 1e4  # wider K tiles "faster"
    monkeypatch.setattr(cs, "chain_ms", chain_ms)
    engine = {nm: GemvConfig(8, 512, 1, 4) for nm in cs.SHAPES}
    other = {nm: GemvConfig(8, 1024, 1, 4) for nm in cs.SHAPES}
    out = cs.alternate_then_sweep(layers, {"engine": engine, "other": other}, "engine",
                                  lambda name, n, k: [GemvConfig(8, bk, 1, 4) for bk in (256, 2048)],
                                  budget=60, t0=__import__("time").time())
    assert seen[:4] == [{nm: bk for nm in cs.SHAPES} for bk in (512, 1024, 512, 1024)]
    assert len(out["times"]["engine"]) == len(out["times"]["other"]) == 2
    tried = {(r["shape"], r["cfg"]["block_k"]) for r in out["rows"]}
    assert tried == {(nm, bk) for nm in cs.SHAPES for bk in (256, 2048)}
    assert all(v == 2 for v in map(len, out["final"].values())) and set(out["final"]) == {"engine", "other", "picks"}
    assert seen[-1] == {nm: 2048 for nm in cs.SHAPES}  # the picks: each shape's fastest candidate
    assert "picks alternated" in capsys.readouterr().out


def test_gemv_chain_sweep_fp8_down_study_picks_a_tile_only_where_it_beats_the_engine(tmp_path, monkeypatch):
    """--fp8-down-study (a stand-in chain, no GPU): every candidate parses into a one-row FP8 config and the engine's
    own down_proj tile is among them (the sweep skips it); the fastest tile is picked and written for the batch-1
    A/B; where none beats the engine's by 0.5%, the pick is empty; kernels.gemv.FP8_DOWN_TILE puts a pick on
    down_proj's shape only, and a malformed one is a clear error."""
    import time

    import bench.gemv_chain_sweep as cs
    import kernels.gemv as kg
    from kernels.gemv import default_config, fp8_tile

    specs = cs.fp8_down_candidates()
    assert len(set(specs)) == len(specs) and {fp8_tile(s) for s in specs} >= {default_config(1, 4096, 14336, 1)}
    assert {fp8_tile(s).row_kernel for s in specs} == {False, True}
    assert {fp8_tile(s).split_k for s in specs} == {1, 2, 4}
    monkeypatch.setattr(cs, "build", lambda dtype: [])
    monkeypatch.setattr(cs.torch.cuda, "empty_cache", lambda: None)
    fast = fp8_tile("8:1024:4:2:2:0")
    monkeypatch.setattr(cs, "chain_ms", lambda layers, cfgs: 2.0 if cfgs["down"] == fast else 2.6)
    assert cs.fp8_down_study(60, time.time(), str(tmp_path))["pick"] == "8:1024:4:2:2:0"
    assert (tmp_path / "fp8_down_pick.txt").read_text() == "8:1024:4:2:2:0"
    monkeypatch.setattr(cs, "chain_ms", lambda layers, cfgs: 2.599 if cfgs["down"] == fast else 2.6)
    assert cs.fp8_down_study(60, time.time(), str(tmp_path))["pick"] == ""
    assert (tmp_path / "fp8_down_pick.txt").read_text() == ""

    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    before = [default_config(1, n, k, 1) for n, k in shapes]
    bf16_down = default_config(1, 4096, 14336, 2)
    monkeypatch.setattr(kg, "FP8_DOWN_TILE", "8:1024:4:2:2:0")
    assert [default_config(1, n, k, 1) for n, k in shapes] == before[:3] + [fast]
    assert default_config(1, 4096, 14336, 2) == bf16_down != fast
    monkeypatch.setattr(kg, "FP8_DOWN_TILE", "8:1024")
    with pytest.raises(ValueError, match="block_n:block_k:warps:split_k:pre_tiles:row_kernel"):
        default_config(1, 4096, 14336, 1)


def test_offline_roofline_counts_decode_gemm_flops_only_when_asked():
    """bench.offline's throughput roofline: without a decode rate each decode step is a weight + KV stream (the
    burst info line's model); with one (the goal's since 2026-12-06), a batch-256 step on the 8B shape is priced at
    its GEMMs' FLOPs (compute-bound), a batch-1 step still at the stream."""
    from bench.common import SHAPES
    from bench.offline import throughput_roofline
    cfg = SHAPES["llama-3.1-8b"]
    tok_s, t_pf, t_dec = throughput_roofline(cfg, 256, 512, 128, 4.2e12, 780)
    assert 8500 < tok_s < 9500 and t_pf > 1 and 0.9 < t_dec < 1.2
    c_tok_s, c_pf, c_dec = throughput_roofline(cfg, 256, 512, 128, 4.2e12, 780, decode_tflops=780)
    assert c_pf == t_pf and c_dec > t_dec + 0.1 and c_tok_s < tok_s
    assert throughput_roofline(cfg, 1, 512, 128, 4.2e12, 780, decode_tflops=780) == \
        throughput_roofline(cfg, 1, 512, 128, 4.2e12, 780)


def test_slot_layouts_are_the_pool_orders_the_allocator_leaves():
    """bench.kernels.slot_layout (bench.probe decode256_layout): every order puts each token at its own slot; page size
    1's decode tokens sit a batch apart, step by step; paged ones run in pages of the request's own."""
    import torch

    from bench.kernels import slot_layout
    B, ctx, dec, page = 4, 12, 5, 2
    for layout in ("contiguous", "engine", "paged", "shuffled"):
        o = slot_layout(B, ctx, layout, dec, page)
        assert o.shape == (B, ctx) and o.unique().numel() == B * ctx, layout
    pre = ctx - dec
    c, e, p = (slot_layout(B, ctx, x, dec, page) for x in ("contiguous", "engine", "paged"))
    assert torch.equal(c, torch.arange(B * ctx).view(B, ctx))
    assert torch.equal(e[:, :pre], torch.arange(B * pre).view(B, pre)) and torch.equal(p[:, :pre], e[:, :pre])
    assert (e[:, pre + 1:] - e[:, pre:-1] == B).all() and torch.equal(e[:, pre], B * pre + torch.arange(B))
    steps = p[:, pre:].diff(dim=1)
    assert (steps[:, 0::2] == 1).all() and (steps[:, 1::2] == B * page - 1).all()
    assert not torch.equal(slot_layout(B, ctx, "shuffled"), c)
    with pytest.raises(ValueError):
        slot_layout(B, ctx, "striped", dec)


def test_tput_alternated_builds_a_fresh_engine_per_variant_under_its_knobs(monkeypatch):
    """bench.probe._tput_alternated (tput_page, decode256_ab, kvfp8_tput): variants alternated round by round, each
    engine built with its fields while its module knobs are set, the knobs restored after."""
    import types

    import bench.probe as bp
    import kernels.attention.triton_decode as td
    built = []

    def fake_engine(**fields):
        built.append((fields, td.STAGE1_TILE))
        return types.SimpleNamespace(runner=types.SimpleNamespace(max_total_tokens=1000), stop=lambda: None)
    walls = iter([2.0, 4.0, 4.0] * 4)
    monkeypatch.setattr(bp, "_tput_engine", fake_engine)
    monkeypatch.setattr(bp, "drive", lambda eng, prompts, params: types.SimpleNamespace(wall_s=next(walls)))
    monkeypatch.setattr(bp, "random_prompts", lambda *a: [])
    out = bp._tput_alternated({"a": ({}, {}), "b": ({"page_size": 16},
                                                    {"kernels.attention.triton_decode.STAGE1_TILE": (32, 4, 3)})}, "t")
    assert built == [({}, None), ({"page_size": 16}, (32, 4, 3))] * 2 and td.STAGE1_TILE is None
    assert [r["variant"] for r in out] == ["a", "a", "b", "b"] * 2 and {r["round"] for r in out} == {0, 1}
    assert all(r["tok_s"] == 256 * 128 / 4.0 for r in out)  # the warm run (2.0 s) is not counted


def test_sse_events_yields_the_data_lines_json_and_stops_at_done():
    """bench.common.sse_events (bench.serving and bench.pd read streams through it): `data:` lines parsed, blank lines,
    comments and the [DONE] sentinel left out."""
    import asyncio
    import types

    from bench.common import sse_events

    async def content():
        for line in (b'data: {"a": 1}\n', b"\n", b": keep-alive\n", b'data: {"error": "x"}\r\n', b"data: [DONE]\n"):
            yield line

    async def collect():
        return [ev async for ev in sse_events(types.SimpleNamespace(content=content()))]
    assert asyncio.run(collect()) == [{"a": 1}, {"error": "x"}]


def test_fp8_bench_reports_the_decode_step_without_the_prefill(tmp_path, monkeypatch, capsys):
    """bench.fp8 on the tiny shape (CPU): the goal's line from the medians of alternated rounds (the throughput run in
    the first only), and beside it each engine's decode step alone (the median period between decode launches, the
    prompt's prefill not spread over it) and their ratio."""
    import functools
    import json
    import sys

    import bench.common
    import bench.fp8
    monkeypatch.setattr(bench.fp8, "model_dir", functools.partial(bench.common.model_dir, root=str(tmp_path / "m")))
    monkeypatch.setattr(sys, "argv", ["fp8", "--shape", "tiny", "--reqs", "2", "--steps", "6", "--rounds", "2", "--out",
                                      str(tmp_path / "out")])
    bench.fp8.main()
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "out" / "fp8.json").read_text())
    a, b = res["none"]["b1_period_ms"], res["fp8"]["b1_period_ms"]
    assert 0 < a and 0 < b
    assert [("tput_tok_s" in f) for f in res["fp8"]["rounds"]] == [True, False]
    steps = sorted(f["b1_step_ms"] for f in res["none"]["rounds"])
    assert res["none"]["b1_step_ms"] == steps[1]  # bench.common.median: the upper of two
    assert "fp8 batch-1 step" in out and "medians of 2 alternated rounds" in out
    assert f"fp8 {b:.3f} ms, bf16 {a:.3f} ms, {b / a:.3f} x" in out
    pa, pb = res["none"]["b1_prefill_ms"], res["fp8"]["b1_prefill_ms"]
    assert f"prefill, beyond the decode steps: fp8 ~{pb:.1f} ms, bf16 ~{pa:.1f} ms" in out


def test_probe_swept_variants_replace_the_swept_shapes_and_keep_the_tables_others():
    """bench.probe's engine A/Bs at a sweep's tiles (bf16_small_m, fp8_small_m): the swept Llama-8B shapes take the
    sweep's best tile, every other shape of the table (the lm_head's) keeps its own, and bf16's variant runs the
    several-row GEMV to 16 rows."""
    import kernels.gemv as kg
    from bench.probe import LLAMA8B_LINEARS, swept_variants
    assert swept_variants({}) == {}
    best = {name: {"tile": [16, 64, 8]} for name in LLAMA8B_LINEARS}
    v = swept_variants({"bf16_small_m": {"best_tiles": best}, "fp8_small_m": {"best_tiles": {"o": {"tile": [64, 64, 4]}}}})
    quant, knobs = v["bf16_rows16_swept"]
    table = knobs["kernels.gemv.BF16_ROWS_TILES"]
    assert quant is None and knobs["kernels.ops.GEMV_MAX_M"] == 16
    assert all(table[shape] == (16, 64, 8) for shape in LLAMA8B_LINEARS.values())
    assert {s: t for s, t in table.items() if s not in LLAMA8B_LINEARS.values()} == \
        {s: t for s, t in kg.BF16_ROWS_TILES.items() if s not in LLAMA8B_LINEARS.values()} != {}
    fp8 = v["fp8_swept"][1]["kernels.gemv.FP8_ROWS_TILES"]
    assert v["fp8_swept"][0] == "fp8" and fp8 == {**kg.FP8_ROWS_TILES, LLAMA8B_LINEARS["o"]: (64, 64, 4)}
