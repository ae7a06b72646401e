"""bench/workloads: the paper's workloads as programs, the offline-optimal hit rate, and the driver run
against the tiny-model stack for a couple of seconds per workload in both modes."""
from __future__ import annotations

import json

import pytest

from bench.workloads.__main__ import main, parse_args
from bench.workloads.programs import WORKLOADS
from bench.workloads.trace import optimal_hit_rate
from services.gateway.programs import validate_program


def test_optimal_hit_rate_of_an_infinite_radix_tree():
    # Two requests share 3 of their 4 prompt tokens: 8 prompt tokens, 5 distinct prefixes.
    assert optimal_hit_rate([([1, 2, 3, 4], [9]), ([1, 2, 3, 5], [])])["optimal_hit_rate"] == pytest.approx(3 / 8)
    # A second turn whose prompt is the first turn's prompt + its answer: the answer was decoded, a hit.
    r = optimal_hit_rate([([1, 2], [3, 4]), ([1, 2, 3, 4, 5], [])])
    assert r["prompt_tokens"] == 7 and r["optimal_hit_rate"] == pytest.approx(1 - 3 / 7)
    assert optimal_hit_rate([])["optimal_hit_rate"] == 0.0


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_is_seeded_and_compiles_to_a_valid_program(name):
    w = WORKLOADS[name]
    a, b, c = w.make(3, 1.0, 7), w.make(3, 1.0, 7), w.make(3, 1.0, 8)
    assert a == b and a != c
    for kwargs in a:
        validate_program(w.program.trace(**kwargs))


def test_lengths_follow_the_originals_shape():
    mmlu = WORKLOADS["mmlu"].make(8, 1.0, 0)
    assert mmlu[0]["shots"].count("Answer:") == 5 and mmlu[0]["shots"] == mmlu[8 % 8]["shots"]
    hs = WORKLOADS["hellaswag"].make(2, 1.0, 0)
    assert hs[0]["shots"].count("Ending:") == 20 and len(hs[0]["endings"]) == 4
    assert 300 < len(WORKLOADS["judge"].make(1, 1.0, 0)[0]["essay"].split()) < 600


def test_driver_arguments_are_checked():
    with pytest.raises(SystemExit):
        parse_args(["--stack", "http://x", "--workloads", "nope"])
    with pytest.raises(SystemExit):
        parse_args([])


@pytest.mark.e2e
def test_driver_runs_every_workload_in_both_modes_on_the_tiny_stack(base_url, tmp_path):
    code = main(["--stack", base_url, "--parallel", "2", "--instances", "2", "--duration", "2", "--scale", "0.05",
                 "--out", str(tmp_path)])
    results = json.loads((tmp_path / "workloads.json").read_text())["results"]
    assert code == 0, [r["error_examples"] for r in results if r["errors"]]
    assert {(r["workload"], r["mode"]) for r in results} == {(w, m) for w in WORKLOADS
                                                             for m in ("interpreter", "endpoint")}
    for r in results:
        assert r["programs"] >= 1 and r["errors"] == 0 and r["programs_per_s"] > 0
        assert 0.0 <= r["hit_rate"] <= 1.0 and 0.0 <= r["optimal_hit_rate"] <= 1.0
    by = {(r["workload"], r["mode"]): r for r in results}
    # Few-shot prompts are mostly shared: both the runtime and the optimum see it.
    assert by[("hellaswag", "interpreter")]["optimal_hit_rate"] > 0.5
    assert by[("hellaswag", "endpoint")]["hit_rate"] > 0.3


def test_ablation_ratios_from_runs(tmp_path):
    import argparse

    from bench.workloads.ablations import _finish, plot

    def row(w, mode, pps, hit=0.5, opt=0.6):
        return {"workload": w, "mode": mode, "programs_per_s": pps, "hit_rate": hit, "optimal_hit_rate": opt,
                "hit_rate_vs_optimal": round(hit / opt, 4)}

    runs = {"baseline": [row("mmlu", "interpreter", 6.0), row("mmlu", "endpoint", 9.0),
                         row("no_reuse", "interpreter", 10.0), row("judge", "interpreter", 2.0),
                         row("judge", "endpoint", 3.0)],
            "radix off": [row("mmlu", "interpreter", 2.0), row("no_reuse", "interpreter", 10.5)],
            "fork hint off": [row("judge", "interpreter", 1.0), row("judge", "endpoint", 4.0)]}
    args = argparse.Namespace(out=str(tmp_path), shape="tiny", instances=2, parallel=2, scale=0.1)
    out = _finish(args, runs)  # fcfs, jump-forward and the client variants did not run (budget): no ratio
    assert out["ratios"]["radix_on_vs_off"] == {"mmlu": 3.0, "no_reuse": 0.952}
    assert out["ratios"]["endpoint_vs_interpreter_rtt0"] == {"mmlu": 1.5, "judge": 1.5}
    assert out["ratios"]["fork_hint_on_vs_off"] == {"judge": 2.0}
    assert out["ratios"]["fork_hint_on_vs_off_endpoint"] == {"judge": 0.75}
    assert out["ratios"]["lpm_vs_fcfs"] == {} and out["summary"]["zero_reuse_overhead"] == 1.05
    assert json.loads((tmp_path / "ablations.json").read_text())["paper_ratios"]["hellaswag"] == 33.0
    plot(out, str(tmp_path / "ablations.png"))  # writes the PNG when matplotlib (the bench extra) is there


def test_every_ablation_stack_starts_with_flags_the_launcher_takes():
    """The plan's stacks differ only in services.launch flags (the fork hint through the gateway's
    --disable-fork-hint); each must parse, and the variant that turns the hint off covers both modes."""
    from bench.workloads.ablations import PLAN
    from services.launch import parse_args as launch_args

    for stack, flags, variants in PLAN:
        args = launch_args(["--model-path", "x", *flags])
        if stack == "fork hint off":
            assert args.disable_fork_hint
            (_, kw), = variants
            assert kw["fork_hint"] is False and set(kw["modes"]) == {"interpreter", "endpoint"}
        else:
            assert not args.disable_fork_hint


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_gives_the_same_answer_remotely(name):
    """Through the program endpoint (the fake server runs services.gateway.programs) each workload's
    program writes the same text and variables as in interpreter mode."""
    import lang_client as sgl
    from tests.support.fake_sglang_server import FakeSGLangServer

    w = WORKLOADS[name]
    with FakeSGLangServer() as srv:
        backend = sgl.RuntimeEndpoint(srv.url)
        for kwargs in w.make(2, 0.05, 1):
            local = w.program.run(backend=backend, temperature=0, **kwargs)
            remote = w.program.run(backend=backend, remote=True, temperature=0, **kwargs)
            assert remote.text() == local.text()
            for var, value in local.variables().items():
                assert remote[var] == value, var


def test_jump_forward_probe_counts_catch_up_passes(tmp_path):
    """bench.workloads.jump_forward_probe on the tiny shape: jump-forward off runs no catch-up pass; jumping
    every forced run (threshold 0) adds catch-up passes and takes fewer steps."""
    from bench.workloads.jump_forward_probe import main as probe

    out = tmp_path / "probe.json"
    results = probe(["--programs", "3", "--parallel", "3", "--stagger", "2", "--scale", "0.02", "--thresholds", "0",
                     "--out", str(out)])
    off, on = results["jump-forward off"], results["jump-forward on, threshold 0"]
    assert off["extend_catchup_passes"] == 0 and off["forced_runs"] == 0
    assert on["extend_catchup_passes"] > 0 and on["forced_tokens"] > 0 and on["steps"] < off["steps"]
    assert json.loads(out.read_text())["results"].keys() == results.keys()
