"""What an operator meets: every flag explained with its default, SGLang's flag names, `--config FILE`,
progress bars that survive the launcher (prefixed per worker), SGLang-named rate gauges, and a dashboard
that queries only metrics the gateway exports."""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys

import pytest
import requests

from services.gateway.__main__ import build_parser as gateway_parser
from services.gateway.http.metrics import GatewayMetrics, RequestTimer
from services.launch import parse_args as launch_args
from services.output_relay import PrefixedRelay, _split
from services.worker.__main__ import parse_args as worker_args
from shared.protocol import TokenOutput
from tests.support.stack import ROOT, Proc, free_port


def _parser_of(parse) -> argparse.ArgumentParser:
    """The parser a service's parse function builds (captured at its parse call)."""
    captured = {}
    original = argparse.ArgumentParser.parse_args

    def capture(self, *a, **kw):
        captured.setdefault("parser", self)
        return original(self, *a, **kw)

    argparse.ArgumentParser.parse_args = capture
    try:
        parse(["--model-path", "m"])
    finally:
        argparse.ArgumentParser.parse_args = original
    return captured["parser"]


PARSERS = {"launch": lambda: _parser_of(launch_args), "worker": lambda: _parser_of(worker_args),
           "gateway": gateway_parser}


@pytest.mark.parametrize("service", list(PARSERS))
def test_every_flag_has_help_and_shows_its_default(service):
    parser = PARSERS[service]()
    missing = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert not missing, f"{service}: flags without help: {missing}"
    text = parser.format_help()
    assert "(default: 30000)" in text or service == "worker"
    if service != "gateway":
        assert "(default: 0.85)" in text and "(default: lpm)" in text  # engine flags too


def test_enable_mixed_chunk_reaches_the_worker_and_choices_are_lists():
    """SGLang's --enable-mixed-chunk: off by default, on when given, passed by the launcher to its workers.
    Every engine flag's choices are a list (a help string there once went unnoticed on a boolean flag)."""
    from shared.engine.cli import _CHOICES, engine_args_to_argv
    assert all(isinstance(v, list) for v in _CHOICES.values()), _CHOICES
    assert not launch_args(["--model-path", "m"]).enable_mixed_chunk
    args = launch_args(["--model-path", "m", "--enable-mixed-chunk"])
    assert args.enable_mixed_chunk and worker_args(engine_args_to_argv(args)).enable_mixed_chunk


def test_sglang_flag_names_and_old_aliases():
    for flag in ("--context-length", "--max-context-len"):
        assert launch_args(["--model-path", "m", flag, "512"]).max_context_len == 512
    args = launch_args(["--model-path", "m", "--disable-cuda-graph", "--disable-overlap-schedule",
                        "--mem-fraction-static", "0.7", "--tp-size", "1"])
    assert not args.cuda_graph and not args.enable_overlap and args.mem_fraction_static == 0.7
    assert not launch_args(["--model-path", "m", "--no-cuda-graph"]).cuda_graph
    with pytest.raises(SystemExit):
        launch_args(["--model-path", "m", "--tp-size", "9"])  # one host has at most 8 GPUs
    # What the launcher passes its workers uses the primary names, and the worker parses it back.
    from shared.engine.cli import engine_args_to_argv

    argv = engine_args_to_argv(launch_args(["--model-path", "m", "--max-context-len", "300", "--disable-cuda-graph"]))
    assert "--context-length" in argv and "--max-context-len" not in argv
    back = worker_args(argv)
    assert back.max_context_len == 300 and not back.cuda_graph


def test_integer_flags_with_a_floor_refuse_what_is_below_it(capsys):
    args = launch_args(["--model-path", "m", "--cuda-graph-max-extend-tokens", "0", "--stream-interval", "3"])
    assert args.cuda_graph_max_extend_tokens == 0 and args.stream_interval == 3
    assert worker_args(["--model-path", "m"]).cuda_graph_max_extend_tokens == 2048
    for flag, value, says in [("--cuda-graph-max-extend-tokens", "-1", "must be at least 0, got -1"),
                              ("--stream-interval", "0", "must be at least 1, got 0"),
                              ("--cuda-graph-max-extend-tokens", "many", "'many' is not an integer")]:
        with pytest.raises(SystemExit):
            launch_args(["--model-path", "m", flag, value])
        assert says in capsys.readouterr().err


def test_decode_attention_and_pdl_flags(capsys):
    """Split decode attention merges in one launch by default (the second kernel on request; the old opt-in
    spelling still parses), at most --triton-attention-num-kv-splits chunks (1 or more), and
    --pdl-early-trigger takes kernel families only; the launcher passes each on to its workers."""
    from shared.engine.cli import engine_args_to_argv
    base = launch_args(["--model-path", "m"])
    assert base.one_launch_decode_attention and base.triton_attention_num_kv_splits == 32
    assert base.pdl_early_trigger == ""
    assert launch_args(["--model-path", "m", "--one-launch-decode-attention"]).one_launch_decode_attention
    args = launch_args(["--model-path", "m", "--two-launch-decode-attention", "--triton-attention-num-kv-splits",
                        "8", "--pdl-early-trigger", "rope+attention"])
    assert not args.one_launch_decode_attention and args.triton_attention_num_kv_splits == 8
    assert args.pdl_early_trigger == "attention,rope"
    back = worker_args(engine_args_to_argv(args))
    assert (not back.one_launch_decode_attention and back.triton_attention_num_kv_splits == 8
            and back.pdl_early_trigger == "attention,rope")
    for flag, value, says in [("--triton-attention-num-kv-splits", "0", "must be at least 1, got 0"),
                              ("--pdl-early-trigger", "attention,gemm", "unknown kernel families ['gemm']")]:
        with pytest.raises(SystemExit):
            launch_args(["--model-path", "m", flag, value])
        assert says in capsys.readouterr().err


def test_fp8_block_flags():
    """Block-scaled FP8 checkpoints are dequantized at load by default (their block GEMM never beat bf16 on the H200);
    --fp8-block-kernels (or --no-dequantize-fp8-blocks) keeps the blocks, the former opt-in spelling
    --dequantize-fp8-blocks still parses; the launcher passes the choice on to its workers."""
    from shared.engine.cli import engine_args_to_argv
    assert launch_args(["--model-path", "m"]).dequantize_fp8_blocks
    assert launch_args(["--model-path", "m", "--dequantize-fp8-blocks"]).dequantize_fp8_blocks
    for flag in ("--fp8-block-kernels", "--no-dequantize-fp8-blocks"):
        args = launch_args(["--model-path", "m", flag])
        assert not args.dequantize_fp8_blocks
        assert "--fp8-block-kernels" in engine_args_to_argv(args)
        assert not worker_args(engine_args_to_argv(args)).dequantize_fp8_blocks


def test_decode_norm_fusion_l2_prefetch_and_rope_fusion_flags():
    """Split residual norms and rope in the qkv epilogue are on by default, --no-decode-norm-fusion and
    --no-decode-rope-fusion turn them off; the L2 prefetch is off by default, --decode-l2-prefetch turns it on; the
    launcher passes them on to its workers."""
    from shared.engine.cli import engine_args_to_argv
    assert launch_args(["--model-path", "m"]).decode_norm_fusion
    args = launch_args(["--model-path", "m", "--no-decode-norm-fusion"])
    assert not args.decode_norm_fusion
    assert "--no-decode-norm-fusion" in engine_args_to_argv(args)
    assert not worker_args(engine_args_to_argv(args)).decode_norm_fusion
    assert not launch_args(["--model-path", "m"]).decode_l2_prefetch
    args = launch_args(["--model-path", "m", "--decode-l2-prefetch"])
    assert args.decode_l2_prefetch and worker_args(engine_args_to_argv(args)).decode_l2_prefetch
    assert launch_args(["--model-path", "m"]).decode_rope_fusion
    args = launch_args(["--model-path", "m", "--no-decode-rope-fusion"])
    assert not args.decode_rope_fusion and not worker_args(engine_args_to_argv(args)).decode_rope_fusion


def test_attention_backend_choices_and_flashinfer_without_its_package(capsys, monkeypatch):
    import importlib.util

    from shared.engine.cli import engine_args_to_argv

    assert launch_args(["--model-path", "m", "--attention-backend", "triton"]).attention_backend == "triton"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer"
                        else real_find_spec(name, *a))
    for parse in (launch_args, worker_args):
        with pytest.raises(SystemExit):
            parse(["--model-path", "m", "--attention-backend", "flashinfer"])
        err = capsys.readouterr().err
        assert "needs the flashinfer-python package" in err and 'pip install -e ".[flashinfer]"' in err
        assert "auto, torch, triton" in err
    # Installed: accepted, and passed on to the worker.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flashinfer"
                        else real_find_spec(name, *a))
    args = launch_args(["--model-path", "m", "--attention-backend", "flashinfer"])
    assert args.attention_backend == "flashinfer"
    assert worker_args(engine_args_to_argv(args)).attention_backend == "flashinfer"
    with pytest.raises(SystemExit):
        launch_args(["--model-path", "m", "--attention-backend", "nope"])
    assert "unknown attention backend 'nope'; choose one of auto, torch, triton, flashinfer" in capsys.readouterr().err


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model-path: some/model\ncontext_length: 2048\nmem-fraction-static: 0.6\n"
                   "disable-radix-cache: true\ncuda_graph: false\nworkers: 2\nstrict: true\n")
    args = launch_args(["--config", str(cfg), "--workers", "3"])
    assert args.model_path == "some/model" and args.max_context_len == 2048 and args.mem_fraction_static == 0.6
    assert args.disable_radix_cache and not args.cuda_graph and args.strict
    assert args.workers == 3  # the command line wins
    gw = gateway_parser()
    from shared.cli_config import parse_with_config

    (tmp_path / "gw.yaml").write_text("model-path: x\nworkers: h:1\nport: 31001\n")
    assert parse_with_config(gw, ["--config", str(tmp_path / "gw.yaml")]).port == 31001
    for bad in ("contxt-length: 5\n", "- a\n- b\n", "disable-radix-cache: maybe\n", "key: [unclosed\n"):
        cfg.write_text(bad)
        with pytest.raises(SystemExit):
            launch_args(["--config", str(cfg)])


def test_launch_help_runs():
    out = subprocess.run([sys.executable, "-m", "services.launch", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--context-length" in out.stdout and "--config FILE" in out.stdout


# ---------------------------------------------------------------- output relay
def test_relay_prefixes_lines_and_progress_redraws():
    assert _split(b"a\nbar 10%\rbar 20%\rpart", b"[w] ") == (b"[w] a\n[w] bar 10%\r[w] bar 20%\r", b"part")
    assert _split(b"line\r", b"[w] ") == (b"", b"line\r")  # maybe the start of \r\n: wait
    sink = io.BytesIO()
    relay = PrefixedRelay("decode-1", sink)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stderr.write('x 1/2\\rx 2/2\\ndone')"],
                            stderr=relay.write_fd)
    relay.child_started()
    proc.wait(30)
    relay.join(30)
    assert sink.getvalue() == b"[decode-1] x 1/2\r[decode-1] x 2/2\n[decode-1] done\n"


@pytest.mark.e2e
def test_weight_loading_progress_reaches_the_launchers_stderr(tmp_path):
    from tests.support.hf_models import make_hf_model, write_hf_checkpoint

    model_dir = write_hf_checkpoint(make_hf_model("qwen2"), str(tmp_path / "ckpt"))
    # READY: every worker has loaded its weights (Proc waits for it under a deadline, reading stdout and stderr to
    # the end; its text mode reads each progress redraw, a \r, as a line of its own).
    launcher = Proc("services.launch", "--model-path", model_dir, "--port", str(free_port()), ready="READY ")
    try:
        err = launcher.text()
    finally:
        launcher.stop()
    bars = [seg for seg in re.split(r"[\r\n]", err) if "Loading weights" in seg]
    assert bars and all(seg.startswith("[unified-0] ") for seg in bars), err[-2000:]
    assert any("100%" in seg for seg in bars), bars


# ---------------------------------------------------------------- metrics and dashboard
def test_rate_gauges_follow_recent_traffic():
    m = GatewayMetrics("x")
    t = RequestTimer(m)
    t.observe(TokenOutput(rid="a", token_ids=[1, 2, 3], text=""))
    t.observe(TokenOutput(rid="a", token_ids=[4], text="", finished=True, prompt_tokens=40, cached_tokens=30,
                          completion_tokens=4))
    start = m._samples[0][0]
    m.update_rates(start + 2.0)
    assert m.gen_throughput._value.get() == pytest.approx(2.0)  # 4 tokens over 2 s
    assert m.cache_hit_rate._value.get() == pytest.approx(0.75)
    m.update_rates(start + 30.0)  # nothing new in the window
    assert m.gen_throughput._value.get() == 0.0 and m.cache_hit_rate._value.get() == 0.0
    m.set_worker_stats([{"kv_usage": 0.5, "max_total_tokens": 1000, "num_running": 2, "num_waiting": 1},
                        {"kv_usage": 0.25, "max_total_tokens": 400}])
    assert m.num_used_tokens._value.get() == 600 and m.token_usage._value.get() == 0.375


def _exported(base_url) -> set[str]:
    text = requests.get(base_url + "/metrics", timeout=10).text
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name)
            if kind == "histogram":
                names |= {name + s for s in ("_bucket", "_sum", "_count")}
            if kind == "counter":
                names.add(name + "_total")
    return names


@pytest.mark.e2e
def test_gateway_exports_sglangs_gauges(base_url):
    requests.post(base_url + "/generate", json={"text": "warm", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    text = requests.get(base_url + "/metrics", timeout=10).text
    for name in ("cache_hit_rate", "gen_throughput", "num_running_reqs", "num_queue_reqs", "token_usage",
                 "num_used_tokens"):
        assert re.search(rf"^sglang:{name}\{{model_name=\"tiny-random\"\}} [0-9.e+-]+$", text, re.M), name


@pytest.mark.e2e
def test_dashboard_queries_only_exported_metrics(base_url):
    with open(os.path.join(ROOT, "deploy", "grafana", "radixserve.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"sglang:[a-z0-9_]+", e)}
    assert {"sglang:cache_hit_rate", "sglang:gen_throughput", "sglang:time_to_first_token_seconds_bucket"} <= used
    missing = used - _exported(base_url)
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["title"]
