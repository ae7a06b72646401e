"""bench/pass_breakdown.py, which bench/structured.py prints: passes by kind with their host phases,
through the real engine, and the engine as it was once it is taken off."""
from __future__ import annotations

import json

from bench.pass_breakdown import PassBreakdown, format_summary
from tests.support.engine_harness import Harness
from tests.engine.test_grammar import SCHEMA, prompt


def test_pass_breakdown_counts_every_pass_by_kind_and_comes_off():
    h = Harness(jump_forward_threshold=0)
    eng = h.engine
    before = {k: getattr(eng, k) for k in ("step", "_process", "_resolve_pending", "_settle_jumps")}
    launch = eng.runner.launch
    bd = PassBreakdown(eng)
    launched = []
    inner = eng.runner.launch

    def counting(batch):
        launched.append(batch.mode.value)
        return inner(batch)
    eng.runner.launch = counting
    sampling = {"json_schema": json.dumps(SCHEMA), "temperature": 0, "max_new_tokens": 120}
    h.run([h.submit(prompt(), sampling=sampling) for _ in range(4)])
    eng.runner.launch = inner
    bd.close()
    s = bd.summary()
    passes = {k: d["passes"] for k, d in s.items() if k not in ("all", "no pass")}
    assert sum(passes.values()) == len(launched) and passes.get("admit") and passes.get("catch-up")
    assert s["all"]["passes"] == len(bd.records) and s["all"]["total_wall_s"] > 0
    catch = s["catch-up"]
    assert catch["tokens"] > catch["rows"] and catch["phases_ms"]["jumps"] > 0 and catch["host_ms"] > 0
    assert "catch-up" in format_summary(s, "jf")
    # Taken off: the engine's own methods again (instance attributes gone).
    assert eng.runner.launch == launch
    for k, v in before.items():
        assert getattr(eng, k) == v and k not in eng.__dict__
