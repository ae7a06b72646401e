"""bench.spec: its per-request figures and exactness count, and a tiny smoke run against the tiny reference models
(skipped only while the engine lacks the speculative-decoding settings)."""
import json
import os

import pytest

from bench import spec


def test_request_figures_count_tokens_after_the_first_output():
    """Acceptance length: decode tokens per output that carried any; tokens/s and TPOT over the span after the first."""
    f = spec.request_figures([(0.0, 1), (1.0, 3), (2.0, 1), (4.0, 4)])
    assert f == {"tok_s": 2.0, "tpot_s": 0.5, "accept": 8 / 3}
    assert spec.request_figures([(0.0, 1)]) == {}


def test_exactness_counts_prompts_and_finds_the_first_difference():
    off = {"code/1": {"tokens": [[1, 2, 3], [4, 5]]}, "code/8": {"tokens": [[7]]}, "engine_init_s": 1.0}
    on = {"code/1": {"tokens": [[1, 2, 3], [4, 6]]}, "code/8": {"tokens": [[7]]}, "engine_init_s": 2.0}
    assert spec.exactness(off, on) == (2, 3, [("code/1", 1, 1)])
    floor = spec.batch_floor({"code/1": {"tokens": [[1], [2]]}, "code/8": {"tokens": [[1], [3]]}}, [1, 8])
    assert floor == {"code/8": 1}


@pytest.mark.skipif(not spec.spec_flags_known(),
                    reason="the engine does not take --speculative-algorithm yet (issue 63 item 2, branch spec63)")
def test_tiny_spec_run_is_exact_and_speculates(tiny_refmodels, tmp_path, capsys):
    models, _, _ = tiny_refmodels
    assert spec.main(["--tiny", "--models", models, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "spec.json").read_text())
    assert set(res["runs"]) == {"off", "NGRAM", "STANDALONE"}
    for m in ("NGRAM", "STANDALONE"):
        same, n, _ = res["exactness"][m]
        assert n == 2 * (2 + 4) and same >= n - 1, res["exactness"]
        assert f"exactness {m}" in out
    runs = {m: {k: r for k, r in res["runs"][m].items() if "/" in k} for m in res["runs"]}  # workload/batch: figures
    assert len(runs["off"]) == 4 and runs["off"].keys() == runs["NGRAM"].keys()
    for m in ("NGRAM", "STANDALONE"):  # each method's drafts were accepted somewhere (the tiny models agree a lot)
        assert max(r["accept_len"] for r in runs[m].values()) > 1.2, (m, runs[m])
    assert all(r["accept_len"] == 1.0 for r in runs["off"].values())
    assert "verification pass of 4 draft tokens" in out and os.path.exists(tmp_path / "spec.json")
    # The speculation's verdicts print before the 8B-shape engine starts: a call cut short there keeps them.
    assert out.index("exactness STANDALONE") < out.index("verification pass against a decode step"), out
    assert "verify" in res  # the JSON rewritten with the verification's figures


@pytest.mark.gpu
def test_verify_costs_replay_the_runners_graphs_on_the_gpu():
    """bench.spec's verification timing on the GPU, tiny shape: the decode step from its CUDA graph, the verify passes
    from the extend graphs (both picked for these sizes), every figure a positive time."""
    v = spec.verify_costs("tiny", [1, 4], [1, 4], 64, reps=3, cuda=True)
    graphs = v.pop("graphs")
    assert sorted(v) == sorted(graphs) == sorted(["decode/1", "decode/4", "verify/1/1", "verify/1/4", "verify/4/1",
                                                  "verify/4/4"])
    assert all(graphs.values()) and all(0 < t < 1 for t in v.values())
