"""Tensor parallelism on the CPU (gloo) with the tiny model: TP=2/4 decode exactly what TP=1 decodes,
each rank loads only its shard of the checkpoint, the worker and the launcher take --tp-size, bad
degrees are refused with a clear error, and no rank process outlives its worker."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from shared import procfs
from shared.models import parallel
from tests.support.stack import ROOT, Proc, Stack, wait_for
from tests.support.engine_harness import Harness

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
SEEDED = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 8, "ignore_eos": True, "seed": 11}
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 60)), [300, 200, 100], list(range(100, 140))]


def _constrained_cases() -> list[dict]:
    from tests.engine.test_grammar import SCHEMA

    cases = [{"json_schema": json.dumps(SCHEMA), "temperature": 1.0, "seed": s, "max_new_tokens": 80} for s in (1, 2)]
    return cases + [{"regex": r"call me at \d{3}-\d{4}, thanks!", "temperature": 0, "max_new_tokens": 40},
                    {"temperature": 1.0, "seed": 5, "frequency_penalty": 0.8, "max_new_tokens": 12, "ignore_eos": True}]


def _run_all(h: Harness, full: bool = True) -> dict:
    """Greedy alone and batched, cache hits (the scheduler rewrites a deduplicated prefix's slots),
    seeded sampling, input/output logprobs (the logits of many rows, computed in chunks), and grammar
    masks, penalties and verified jump-forward (rank 0 alone holds their state; a rejected proposal
    rewinds a request's next input on every rank)."""
    out = {"alone": [h.generate(p, sampling=GREEDY)["ids"] for p in PROMPTS]} if full else {}
    out["batched"] = [r["ids"] for r in h.run([h.submit(p, sampling=GREEDY) for p in PROMPTS])]
    out["seeded"] = [r["ids"] for r in h.run([h.submit(p, sampling=SEEDED) for p in PROMPTS])]
    if not full:
        return out
    lp = h.generate(PROMPTS[1], sampling=GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    out["lp_ids"], out["logprobs"], out["input_logprobs"] = lp["ids"], lp["logprobs"], lp["input_logprobs"]
    from tests.engine.test_grammar import prompt

    jumped = h.engine.jump_forward_tokens
    out["constrained"] = [r["ids"] for r in h.run([h.submit(prompt(), sampling=s) for s in _constrained_cases()])]
    assert h.engine.jump_forward_tokens > jumped
    return out


def _close(a, b) -> bool:
    """[[logprob, token], ...] lists: same tokens, logprobs equal to float rounding (the all-reduce sums
    partial products in another order)."""
    return len(a) == len(b) and all(
        x[1] == y[1] and (x[0] is None) == (y[0] is None) and (x[0] is None or abs(x[0] - y[0]) < 1e-4)
        for x, y in zip(a, b))


@pytest.fixture(scope="module")
def tp1():
    h = Harness(jump_forward_mode="verify")
    yield _run_all(h)
    h.engine.stop()


def _follower_pids(h: Harness) -> list[int]:
    return [p.pid for p in h.engine.runner.tp.procs]


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_engine_matches_single_rank(tp1, tp):
    if torch.cuda.is_available() and torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} on the GPU needs {tp} GPUs")
    h = Harness(tp_size=tp, jump_forward_mode="verify")
    pids = _follower_pids(h)
    try:
        assert len(pids) == tp - 1 and all(procfs.alive(p) for p in pids)
        with pytest.raises(RuntimeError, match="alive in this process"):
            Harness()  # would reset the process's rank state under the live TP model
        got = _run_all(h, full=tp == 2)  # 4 ranks on a CI machine's few cores: the short run
        # Each rank holds its share of the kv heads (tiny-random: 2; with 4 ranks each is replicated twice).
        assert h.engine.runner.kv_pool.num_kv_heads == max(1, 2 // tp)
    finally:
        h.engine.stop()
    for key in got:
        if key in ("logprobs", "input_logprobs"):
            assert _close(got[key], tp1[key]), key
        else:
            assert got[key] == tp1[key], key
    if tp == 2:
        assert got["alone"] == got["batched"] and len(got["input_logprobs"]) == len(PROMPTS[1])
    wait_for(lambda: not any(procfs.alive(p) for p in pids), 10, "tensor-parallel ranks to exit")
    assert parallel.tp_size() == 1  # the process's rank state is reset with its group


def test_tp_retokenized_jumps_under_overlap_match_single_rank():
    """Grammar masks fill while the forward runs (overlap stays on): a request that jumps leaves the
    launched pass on every rank (its row's token is not broadcast, its next input is set on every rank),
    and the catch-up pass after the jump extends the other requests with their last token still on the
    device, which every rank substitutes from its own copy of rank 0's samples. (The engine processes
    a step whose tokens will likely jump before scheduling the next; told they never will, every jump
    meets a launched pass, as here.)"""
    from shared.models.forward_batch import ForwardMode
    from shared.engine.request import PENDING_TOKEN
    from tests.engine.test_grammar_overlap import _requests, _run

    results, riders = [], []
    for tp in (1, 2):
        h = Harness(tp_size=tp, jump_forward_mode="retokenize", jump_forward_threshold=0)
        h.engine._jumps_likely_after = lambda handle: False
        launch, seen = h.engine.runner.launch, [0]

        def counting(batch, launch=launch, seen=seen):
            seen[0] += batch.mode == ForwardMode.EXTEND and PENDING_TOKEN in batch.input_ids
            return launch(batch)
        h.engine.runner.launch = counting
        try:
            results.append(_run(h, _requests()))
            riders.append(seen[0])
        finally:
            h.engine.stop()
    assert results[0] == results[1] and riders[1] > 0, riders


def test_tp_mixed_chunks_match_single_rank():
    """--enable-mixed-chunk under TP=2: riders in prefill passes carry their pending token on every rank
    (substituted from each rank's own copy of rank 0's samples); the tokens of TP=1 without mixing."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("TP=2 on the GPU needs 2 GPUs")
    from shared.models.forward_batch import ForwardMode
    from shared.engine.request import PENDING_TOKEN

    prompts = [list(range(10 + 7 * i, 40 + 7 * i)) for i in range(6)]
    results, riders = [], [0]
    for tp, mixed in ((1, False), (2, True)):
        h = Harness(tp_size=tp, enable_mixed_chunk=mixed, max_prefill_tokens=48, chunked_prefill_size=32)
        launch = h.engine.runner.launch

        def counting(batch, launch=launch):
            riders[0] += batch.mode == ForwardMode.EXTEND and PENDING_TOKEN in batch.input_ids
            return launch(batch)
        h.engine.runner.launch = counting
        try:
            rids = [h.submit(p, sampling={**GREEDY, "max_new_tokens": 10}) for p in prompts[:2]]
            for _ in range(3):
                h.engine.step()
            rids += [h.submit(p, sampling=SEEDED if i % 2 else GREEDY) for i, p in enumerate(prompts[2:])]
            results.append([r["ids"] for r in h.run(rids)])
        finally:
            h.engine.stop()
    assert results[0] == results[1] and riders[0] > 0


@pytest.mark.parametrize("family", ["llama_bias", "qwen2", "tied"])
def test_tp_families_match_single_rank(family, tmp_path):
    """Row-parallel biases added once, one kv head replicated on both ranks (qwen2), a vocab-parallel
    lm_head tied to the embedding, each loaded from a transformers checkpoint."""
    from tests.support.hf_models import make_hf_model, write_hf_checkpoint

    path = write_hf_checkpoint(make_hf_model(family), str(tmp_path))
    prompts = [PROMPTS[0], PROMPTS[1]]
    results = []
    for tp in (1, 2):
        h = Harness(model_path=path, tp_size=tp)
        try:
            results.append([r["ids"] for r in h.run([h.submit(p, sampling=GREEDY) for p in prompts])])
        finally:
            h.engine.stop()
    assert results[0] == results[1]


@pytest.mark.parametrize("fmt", ["fbgemm-per-channel", "fp8-block"])
def test_tp_fp8_checkpoint_matches_single_rank(fmt, tmp_path):
    """FP8 weights with per-row scales: a column-parallel layer takes its rows' scales, a row-parallel
    one keeps every row's scale. With block scales both split with the weight, in blocks: a column-parallel
    layer's block rows, a row-parallel one's block columns (the replicated k/v projection's whole)."""
    from tests.support.hf_models import make_hf_model
    from tests.engine.test_quantization import write_fp8_checkpoint

    path = write_fp8_checkpoint(make_hf_model("qwen2"), str(tmp_path), fmt)
    results = []
    for tp in (1, 2):
        # Block scales kept (--fp8-block-kernels): the engine's default dequantizes them at load.
        h = Harness(model_path=path, tp_size=tp, dequantize_fp8_blocks=False)
        try:
            results.append([r["ids"] for r in h.run([h.submit(p, sampling=GREEDY) for p in PROMPTS[:2]])])
        finally:
            h.engine.stop()
    assert results[0] == results[1]


# ------------------------------------------------------------------ sharded loading
class _RecordingOpen:
    """safe_open that records what is read: whole tensors (get_tensor) and slices with their shapes."""

    def __init__(self, real, log):
        self.real, self.log = real, log

    def __call__(self, *a, **kw):
        outer = self

        class Handle:
            def __init__(self):
                self.f = outer.real(*a, **kw)

            def __enter__(self):
                self.h = self.f.__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def keys(self):
                return self.h.keys()

            def get_tensor(self, name):
                outer.log.append((name, "whole", None))
                return self.h.get_tensor(name)

            def get_slice(self, name):
                sl = self.h.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return sl.get_shape()

                    def __getitem__(self, idx):
                        t = sl[idx]
                        outer.log.append((name, "slice", tuple(t.shape)))
                        return t

                return Slice()

        return Handle()


def test_sharded_load_reads_only_this_ranks_slices(tmp_path, monkeypatch):
    from shared.models import loader
    from shared.models.tiny_random import save_tiny_random_checkpoint, tiny_random_state_dict

    path = str(tmp_path / "tiny")
    save_tiny_random_checkpoint(path)
    full = tiny_random_state_dict()
    reads: list = []
    monkeypatch.setattr(loader, "safe_open", _RecordingOpen(loader.safe_open, reads))
    parallel.set_tp(1, 2)  # rank 1 of 2; loading itself needs no collective
    try:
        model, cfg = loader.load_model(path, dtype=torch.float32, device="cpu")
    finally:
        parallel.set_tp(0, 1)
    assert not [r for r in reads if r[1] == "whole"]
    got = {name: shape for name, kind, shape in reads}
    L = "model.layers.0."
    # Column-parallel: half of the output rows; row-parallel: half of the input columns; vocab: half the rows.
    assert got[L + "mlp.gate_proj.weight"] == (64, 64) and full[L + "mlp.gate_proj.weight"].shape == (128, 64)
    assert got[L + "mlp.down_proj.weight"] == (64, 64) and full[L + "mlp.down_proj.weight"].shape == (64, 128)
    assert got[L + "self_attn.q_proj.weight"] == (32, 64) and got[L + "self_attn.k_proj.weight"] == (16, 64)
    assert got[L + "self_attn.o_proj.weight"] == (64, 32)
    assert got["model.embed_tokens.weight"] == (256, 64) and got["lm_head.weight"] == (256, 64)
    assert got["model.norm.weight"] == (64,)  # replicated
    # ... and the values are rank 1's parts.
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q, k, v = attn.qkv_proj.weight.split([32, 16, 16])
    assert torch.equal(q, full[L + "self_attn.q_proj.weight"][32:])
    assert torch.equal(k, full[L + "self_attn.k_proj.weight"][16:])
    assert torch.equal(v, full[L + "self_attn.v_proj.weight"][16:])
    assert torch.equal(attn.o_proj.weight, full[L + "self_attn.o_proj.weight"][:, 32:])
    assert torch.equal(mlp.down_proj.weight, full[L + "mlp.down_proj.weight"][:, 64:])
    assert torch.equal(mlp.gate_up_proj.weight[64:], full[L + "mlp.up_proj.weight"][64:])
    assert torch.equal(model.lm_head.weight, full["lm_head.weight"][256:])


def test_block_fp8_scales_split_with_their_weights(tmp_path):
    """Rank 1 of 2 loading a block-scaled FP8 checkpoint ([16, 16] blocks) keeps FP8 weights with the block
    scales of exactly its part: a column-parallel layer's block rows (per fused projection, the replicated
    k/v whole), a row-parallel one's block columns."""
    from tests.support.hf_models import make_hf_model
    from tests.engine.test_quantization import write_fp8_checkpoint
    from shared.models import loader
    from safetensors.torch import load_file

    path = write_fp8_checkpoint(make_hf_model("qwen2"), str(tmp_path), "fp8-block")
    full = load_file(os.path.join(path, "model.safetensors"))
    parallel.set_tp(1, 2)
    try:
        model, cfg = loader.load_model(path, dtype=torch.float32, device="cpu")
    finally:
        parallel.set_tp(0, 1)
    L = "model.layers.0."
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_proj.weight.dtype == torch.float8_e4m3fn and attn.qkv_proj.weight_block == (16, 16)
    sq, sk, sv = attn.qkv_proj.weight_scale.split([2, 1, 1])  # q: 32 of 64 rows; k, v: 16 rows, replicated
    assert torch.equal(sq, full[L + "self_attn.q_proj.weight_scale_inv"][2:])
    assert torch.equal(sk, full[L + "self_attn.k_proj.weight_scale_inv"])
    assert torch.equal(sv, full[L + "self_attn.v_proj.weight_scale_inv"])
    assert torch.equal(attn.o_proj.weight_scale, full[L + "self_attn.o_proj.weight_scale_inv"][:, 2:])
    assert torch.equal(mlp.down_proj.weight_scale, full[L + "mlp.down_proj.weight_scale_inv"][:, 4:])
    assert torch.equal(mlp.gate_up_proj.weight_scale[4:], full[L + "mlp.up_proj.weight_scale_inv"][4:])
    assert torch.equal(mlp.down_proj.weight.view(torch.uint8),
                       full[L + "mlp.down_proj.weight"][:, 64:].view(torch.uint8))


def test_kv_heads_replicate_and_vocab_pads_when_ranks_do_not_divide():
    from shared.models.layers import Embedding
    from shared.models.weights import checkpoint_layout, load_weights

    # 2 kv heads over 4 ranks: ranks 0,1 hold kv head 0, ranks 2,3 hold kv head 1 (the heads their q use).
    parallel.set_tp(3, 4)
    try:
        assert parallel.kv_head_range(2) == (1, 1) and parallel.local_heads(4) == 1
        holder = torch.nn.Module()
        holder.emb = emb = Embedding(10, 3, parallel=True)  # 10 rows over 4 ranks: 3 each, rank 3: row 9 + 2 pads
        table = torch.arange(30, dtype=torch.float32).view(10, 3)
        load_weights(holder, [("emb.weight", table)])
    finally:
        parallel.set_tp(0, 1)
    assert emb.weight.shape == (3, 3)
    assert torch.equal(emb.weight[0], table[9]) and not emb.weight[1:].any()
    assert checkpoint_layout(holder)["emb.weight"].checkpoint_shape() == (10, 3)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("argv, message", [
    (["--tp-size", "9"], "between 1 and 8"),
    (["--tp", "0"], "between 1 and 8"),
    (["--tp-size", "two"], "not an integer"),
])
def test_cli_refuses_tp_size_out_of_range(argv, message, capsys):
    from services.worker.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model-path", "tiny-random", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.e2e
def test_worker_refuses_tp_size_not_dividing_the_heads():
    """Refused before any rank starts, as one `error:` line (no traceback)."""
    proc = subprocess.run([sys.executable, "-m", "services.worker", "--model-path", "tiny-random",
                           "--device", "cpu", "--tp-size", "3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "error: --tp-size 3 does not divide the model's 4 attention heads" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_kv_pages_leave_whole_whatever_the_sharding():
    """PD moves the model's whole KV (every kv head), so pools sharded differently can exchange pages:
    rank 0 of a TP=2 engine gathers the same buffer a TP=1 engine does, and a buffer scattered into the
    TP=2 pool reads back whole."""
    from tests.support.engine_harness import tokenizer

    ids = tokenizer().encode("whole kv pages across ranks")
    bufs = []
    for tp in (1, 2):
        h = Harness(tp_size=tp)
        try:
            rid = h.submit(ids, sampling={**GREEDY, "max_new_tokens": 1})
            h.run([rid])
            slots = h.engine.cache.match_prefix(ids, record=False).slots  # the prompt's KV, in the tree
            assert len(slots) >= len(ids) - 1
            runner = h.engine.runner
            assert runner.kv_layout()[2] == 2  # tiny-random: 2 kv heads, one per rank at TP=2
            buf = runner.gather_kv(slots)
            assert list(buf.shape) == [len(slots), *runner.kv_layout()]
            bufs.append(buf.clone())
            if tp == 2:
                # A buffer of other positions or dtype is refused before the broadcast it would size wrongly.
                for bad in (buf[:-1], buf.double()):
                    with pytest.raises(ValueError, match="does not fit"):
                        runner.scatter_kv(slots, bad)
                runner.scatter_kv(slots, torch.zeros_like(buf))
                assert runner.gather_kv(slots).abs().sum() == 0
                runner.scatter_kv(slots, bufs[0])
                assert torch.allclose(runner.gather_kv(slots), bufs[0], atol=1e-5)
        finally:
            h.engine.stop()
    assert torch.allclose(bufs[0], bufs[1], atol=1e-4)


def test_tp_fp8_kv_cache_decodes_and_gathers_what_one_rank_does():
    """An FP8 KV pool sharded over two ranks: the tokens of one rank's FP8 pool, and the whole-model pages its ranks
    gather (FP8 bytes through gloo's collectives) and scatter back are the same."""
    from tests.support.engine_harness import tokenizer

    ids = tokenizer().encode("fp8 kv pages across ranks")
    got = []
    for tp in (1, 2):
        h = Harness(tp_size=tp, kv_cache_dtype="fp8_e4m3")
        try:
            assert h.engine.runner.kv_pool.k_buffers[0].dtype == torch.float8_e4m3fn
            out = [r["ids"] for r in h.run([h.submit(p, sampling=GREEDY) for p in PROMPTS + [ids]])]
            slots = h.engine.cache.match_prefix(ids, record=False).slots
            runner = h.engine.runner
            buf = runner.gather_kv(slots)
            assert buf.dtype == torch.float8_e4m3fn and list(buf.shape) == [len(slots), *runner.kv_layout()]
            if tp == 2:
                runner.scatter_kv(slots, torch.zeros_like(buf))
                assert runner.gather_kv(slots).float().abs().sum() == 0
                runner.scatter_kv(slots, got[0][1])
                assert torch.equal(runner.gather_kv(slots).float(), got[0][1].float())
            got.append((out, buf.clone()))
        finally:
            h.engine.stop()
    assert got[0][0] == got[1][0]
    assert torch.equal(got[0][1].float(), got[1][1].float())


# ------------------------------------------------------------------ end to end
def _unsharded(prompt: str) -> dict:
    """What one unsharded engine generates for `prompt` (what _generate asks a stack for)."""
    from tests.support.engine_harness import tokenizer

    h = Harness()
    try:
        return h.generate(tokenizer().encode(prompt), sampling={**GREEDY, "max_new_tokens": 6})
    finally:
        h.engine.stop()


def _generate(url: str, prompt: str) -> dict:
    body = json.dumps({"text": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 6}}).encode()
    req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.e2e
def test_tp2_stack_serves_what_tp1_decodes():
    prompt = "tensor parallel hello"
    want = _unsharded(prompt)
    stack = Stack("--tp-size", "2", "--device", "cpu", timeout=180)
    try:
        ranks = [p for p in procfs.descendants(stack.proc.pid) if "shared.engine.tp_follower" in procfs.argv(p)]
        assert len(ranks) == 1  # one worker, one rank beside it
        got = _generate(stack.url, prompt)
        assert got["output_ids"] == want["ids"] and got["text"] == want["text"]
        with urllib.request.urlopen(stack.url + "/server_info", timeout=30) as r:
            assert [w["info"]["tp_size"] for w in json.loads(r.read())["workers"]] == [2]
    finally:
        stack.stop()
    wait_for(lambda: not any(procfs.alive(p) for p in ranks), 15, "the worker's rank to exit")


@pytest.mark.e2e
def test_pd_with_tp2_on_both_sides_serves_what_tp1_decodes():
    """PD with tensor parallelism: a TP=2 prefill worker's ranks gather their kv heads, rank 0 sends the
    whole KV over UCX, the TP=2 decode worker's rank 0 broadcasts it and each rank keeps its heads; the
    tokens are those of one unsharded engine."""
    prompt = "disaggregated and tensor parallel"
    want = _unsharded(prompt)
    stack = Stack("--topology", "pd", "--tp-size", "2", "--device", "cpu", timeout=240)
    try:
        ranks = [p for p in procfs.descendants(stack.proc.pid) if "shared.engine.tp_follower" in procfs.argv(p)]
        assert len(ranks) == 2  # one beside the prefill worker, one beside the decode worker
        for _ in range(2):  # the second time the decode worker's own tree may hold the prompt
            got = _generate(stack.url, prompt)
            assert got["output_ids"] == want["ids"] and got["text"] == want["text"]
        with urllib.request.urlopen(stack.url + "/server_info", timeout=30) as r:
            workers = json.loads(r.read())["workers"]
        assert sorted(w["info"]["tp_size"] for w in workers) == [2, 2]
        assert any(w["info"].get("kv_transfer", {}).get("received_tokens", 0) > 0 for w in workers), workers
    finally:
        stack.stop()
    wait_for(lambda: not any(procfs.alive(p) for p in ranks), 15, "the workers' ranks to exit")


def test_launcher_gives_each_pd_pool_its_tp_size_and_gpus():
    from services.launch import parse_args, worker_cmds

    args = parse_args(["--model-path", "tiny-random", "--topology", "pd", "--prefill", "2", "--prefill-tp-size", "2",
                       "--decode-tp-size", "1", "--worker-gpus", "0,1,2,3,4"])
    cmds = {name: build(1234) for name, build in worker_cmds(args)}

    def flag(argv, name):
        return argv[len(argv) - 1 - argv[::-1].index(name) + 1] if name in argv else None  # the last one wins

    assert [(n, flag(a, "--tp-size") or "1", flag(a, "--device")) for n, a in cmds.items()] == [
        ("prefill-0", "2", "cuda:0"), ("prefill-1", "2", "cuda:2"), ("decode-2", "1", "cuda:4")]
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "tiny-random", "--prefill-tp-size", "2"])  # unified: no prefill pool


@pytest.mark.e2e
def test_pd_with_unequal_tp_serves_what_tp1_decodes():
    """A TP=2 prefill worker feeds an unsharded decode worker: the wire carries the model's whole KV."""
    prompt = "two ranks hand over to one"
    want = _unsharded(prompt)
    stack = Stack("--topology", "pd", "--prefill-tp-size", "2", "--device", "cpu", timeout=240)
    try:
        got = _generate(stack.url, prompt)
        assert got["output_ids"] == want["ids"] and got["text"] == want["text"]
        with urllib.request.urlopen(stack.url + "/server_info", timeout=30) as r:
            workers = json.loads(r.read())["workers"]
        assert sorted(w["info"]["tp_size"] for w in workers) == [1, 2]
    finally:
        stack.stop()


def _tp2_worker() -> tuple[Proc, int]:
    """A ready --tp-size 2 worker process and the pid of its second rank."""
    proc = Proc("services.worker", "--model-path", "tiny-random", "--device", "cpu", "--tp-size", "2",
                "--max-total-tokens", "4096", ready="WORKER READY")
    ranks = [p for p in procfs.descendants(proc.pid) if "shared.engine.tp_follower" in procfs.argv(p)]
    assert len(ranks) == 1 and proc.poll() is None
    return proc, ranks[0]


@pytest.mark.e2e
def test_rank_dies_with_its_worker():
    """SIGKILL on the worker (no chance to stop its ranks): the kernel ends them (PR_SET_PDEATHSIG)."""
    proc, rank = _tp2_worker()
    proc.proc.kill()  # the worker alone, not its group
    proc.wait()
    wait_for(lambda: not procfs.alive(rank), 15, "the orphaned rank to exit")


@pytest.mark.e2e
def test_worker_exits_when_a_rank_dies():
    """A dead rank would leave the worker's next collective waiting forever: the worker exits instead
    (its supervisor restarts the whole group)."""
    proc, rank = _tp2_worker()
    try:
        os.kill(rank, signal.SIGKILL)
        assert proc.wait(timeout=15) == 70
        wait_for(lambda: "tensor-parallel rank 1 died" in proc.text(), 10, "the worker's last words")
    finally:
        proc.stop(signal.SIGKILL)


def test_follower_device_never_makes_the_base_gpu_current(monkeypatch):
    """A follower goes straight to its own GPU: making rank 0's GPU current on the way (as resolving the base
    device did) creates a CUDA context there, ~0.5 GB of rank 0's GPU a follower (CUDA 12)."""
    from shared.engine import tp as tp_mod

    made = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made.append(torch.device(d)))
    assert tp_mod.follower_device("cuda:2", 1) == torch.device("cuda", 3)
    assert made == [torch.device("cuda", 3)]
    assert tp_mod.follower_device("cpu", 1) == torch.device("cpu") and len(made) == 1


def test_rank0_failing_after_sending_a_pass_ends_the_group(monkeypatch):
    """Rank 0's forward raises after the followers were sent the pass: they are left in its collectives, which
    rank 0's next ones would pair with (a hang, or garbage on NCCL). The worker ends with its ranks instead of
    recovering the step as one device does."""
    from shared.engine import tp as tp_mod

    class Ended(BaseException):
        pass

    codes = []

    def fake_exit(code):
        codes.append(code)
        raise Ended

    h = Harness(tp_size=2)
    tp = h.engine.runner.tp
    try:
        def broken(fb):
            raise RuntimeError("injected")

        h.engine.runner.model.forward = broken
        monkeypatch.setattr(tp_mod.os, "_exit", fake_exit)
        with pytest.raises(Ended):
            h.generate(PROMPTS[0], sampling=GREEDY)
        assert codes == [70]
        assert all(p.wait(timeout=10) == -signal.SIGKILL for p in tp.procs)
    finally:
        for p in tp.procs:
            if p.poll() is None:
                p.kill()
        tp_mod.leave_process_group(graceful=False)
        h.engine.stop()
        for conn in tp.conns:
            conn.close()


def test_watchdog_logs_what_a_dead_follower_sent(monkeypatch, caplog):
    """A follower failing after ready() (its KV pool sizing on a GPU with less free memory than rank 0's, say)
    sends its traceback down the pipe and exits: the watchdog logs it with the death, not just the exit code."""
    from multiprocessing import Pipe

    from shared.engine import tp as tp_mod

    class Ended(BaseException):
        pass

    def fake_exit(code):
        raise Ended

    class Dead:
        returncode = 1

        def poll(self):
            return 1

    ours, theirs = Pipe()
    theirs.send(("error", "Traceback ...\nRuntimeError: only 0.3 GiB left for the KV cache"))
    leader = tp_mod.TPLeader.__new__(tp_mod.TPLeader)
    leader.procs, leader.conns, leader._closed = [Dead()], [ours], False
    monkeypatch.setattr(tp_mod.os, "_exit", fake_exit)
    with caplog.at_level("CRITICAL"), pytest.raises(Ended):
        leader._watch()
    assert "rank 1 died (exit code 1)" in caplog.text and "only 0.3 GiB left" in caplog.text


def test_group_teardown_is_bounded(monkeypatch, caplog):
    """A process-group teardown stuck in the backend (NCCL's hung the worker's shutdown on the H200) is
    left behind after the bound instead of hanging the worker that is shutting down."""
    import threading
    import time

    import torch.distributed as dist

    from shared.engine import tp as tp_mod

    release = threading.Event()
    monkeypatch.setattr(tp_mod, "_TEARDOWN_TIMEOUT_S", 0.3)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: release.wait(30))
    t0 = time.monotonic()
    try:
        with caplog.at_level("WARNING"):
            tp_mod.leave_process_group()
        assert time.monotonic() - t0 < 5
        assert "did not finish" in caplog.text and tp_mod.teardown_stuck()
    finally:
        release.set()
        tp_mod._teardown_stuck = False
