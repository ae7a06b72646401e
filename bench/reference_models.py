"""Reference models trained here: a byte-level BPE tokenizer and two Llama-architecture models (a target and a draft
sharing the tokenizer) trained on this interpreter's own Python sources, written as ordinary Hugging Face checkpoints
that the server and transformers both load. Deterministic from --seed (the split, the tokenizer, the initialization
and the data order; the step count fits --target-minutes / --draft-minutes unless --target-steps / --draft-steps fix
it: the manifest records the counts a run chose).

    python -m bench.reference_models [--out /tmp/refmodels] [--seed 0] [--target-minutes 3.5] [--tiny]

Writes to --out: target/ and draft/ (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a
chat template, generation_config.json), heldout.txt (the held-out files, never trained on) and heldout.jsonl (their
text: bench.spec's prompts), manifest.json (the settings' hash, the shapes, the steps, the figures). A directory that
holds a finished run of the same settings is reused: nothing is trained again (--force retrains).

Checks, each a PASS/FAIL line: held-out loss of both models; our engine's greedy continuation and per-token logprobs
against transformers' on the same checkpoint (held-out prompts); the target's held-out loss through the engine with
--quantization fp8 against bf16 (goal: within 1%). --tiny: a few MB of text and tiny models, seconds on a CPU.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import time

import numpy as np
import torch

from bench import reference_corpus as corpus
from bench import reference_train as rt
from bench.common import GREEDY, drive

GOAL_FP8_LOSS = 1.01  # fp8 / bf16 held-out loss through the engine
# Engine vs transformers on the same checkpoint: per dtype, (largest gap between transformers' best logprob and that
# of the engine's greedy token: 0 where the engine picked transformers' argmax, small at a near tie; mean |logprob
# difference| of the engine's tokens).
PARITY_TOL = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (0.25, 0.05)}
TRAINING_KEYS = ("seed", "tiny", "target_minutes", "draft_minutes", "target_shape", "target_steps", "draft_steps",
                 "vocab", "seq_len", "batch", "max_mb", "heldout_permille", "min_tokens_per_param", "compile")
MANIFEST = "manifest.json"
log = rt.log


def settings(args) -> dict:
    """The flags that decide what is trained (after --tiny's defaults), and their hash."""
    d = {k: getattr(args, k) for k in TRAINING_KEYS}
    d["hash"] = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    return d


def finished_manifest(out: str, want_hash: str | None = None, trained_only: bool = False) -> dict | None:
    """The manifest of a finished run in `out` (of the settings hash, when given), else None. trained_only: a run
    whose models are written, its checks perhaps not run yet."""
    try:
        with open(os.path.join(out, MANIFEST)) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    if not m.get("trained" if trained_only else "finished"):
        return None
    if want_hash and m.get("settings", {}).get("hash") != want_hash:
        return None
    return m


def write_manifest(out: str, m: dict) -> None:
    with open(os.path.join(out, MANIFEST + ".tmp"), "w") as f:
        json.dump(m, f, indent=1)
    os.replace(os.path.join(out, MANIFEST + ".tmp"), os.path.join(out, MANIFEST))


def read_heldout(out: str) -> list[tuple[str, str]]:
    with open(os.path.join(out, "heldout.jsonl")) as f:
        return [(d["rel"], d["text"]) for d in map(json.loads, f)]


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def pick_target_shape(args, cfg_of, data, device) -> tuple[str, tuple]:
    """The largest ladder shape that sees >= min_tokens_per_param tokens a parameter in the budget, at the rate
    measured for it here (the smallest when none does)."""
    if args.tiny:
        return "tiny", rt.TINY_TARGET
    names = list(rt.TARGET_LADDER) if args.target_shape == "auto" else [args.target_shape]
    for i, name in enumerate(names):
        shape = rt.TARGET_LADDER[name]
        if len(names) == 1 or args.target_steps:
            return name, shape
        model = rt.build_model(cfg_of(shape), args.seed, device)
        params = rt.count_params(model)
        step_s = rt.measure_step_s(model, data, rt.TrainSpec(shape, args.seq_len, args.batch, 0, 0), device) * 1.3
        tokens = args.target_minutes * 60 / step_s * args.batch * args.seq_len
        del model
        _free(device == "cuda")
        log(f"target {name}: {params / 1e6:.0f}M parameters, ~{tokens / 1e6:.0f}M tokens in "
            f"{args.target_minutes} min ({tokens / params:.2f} a parameter; want >= {args.min_tokens_per_param})")
        if tokens >= args.min_tokens_per_param * params or i == len(names) - 1:
            return name, shape
    raise AssertionError("unreachable")


def train_all(args, out: str, device: str) -> dict:
    t_start = time.perf_counter()
    # gpu_run.sh turns tokenizers' threads off for the servers it starts; the BPE training and the corpus encoding
    # want every core (on one core they take about ten times as long, minutes of a 10-minute call).
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    res: dict = {"settings": settings(args), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                 "torch": torch.__version__}
    files = corpus.collect_sources()
    train, held = corpus.split_corpus(files, args.heldout_permille, int(args.max_mb * 1e6),
                                      max(int(args.max_mb * 1e6 * 0.1), 200_000))
    res["corpus"] = {"files": len(files), "roots": corpus.source_roots(), "train_files": len(train),
                     "train_bytes": sum(len(t) for _, t in train), "heldout_files": len(held),
                     "heldout_bytes": sum(len(t) for _, t in held)}
    log(f"corpus: {len(files)} files; training on {len(train)} ({res['corpus']['train_bytes'] / 1e6:.1f} MB), "
        f"{len(held)} held out ({res['corpus']['heldout_bytes'] / 1e6:.1f} MB)")
    with open(os.path.join(out, "heldout.txt"), "w") as f:
        f.writelines(rel + "\n" for rel, _ in held)
    with open(os.path.join(out, "heldout.jsonl"), "w") as f:
        f.writelines(json.dumps({"rel": rel, "text": text}) + "\n" for rel, text in held)

    t0 = time.perf_counter()
    tok_texts, n = [], 0
    for _, text in train:  # the tokenizer learns from the first tokenizer_mb of the (hash-ordered) training text
        if n >= args.tokenizer_mb * 1e6:
            break
        tok_texts.append(text)
        n += len(text)
    tok = corpus.train_tokenizer(tok_texts, args.vocab)
    vocab = tok.get_vocab_size()
    dtype = np.uint16 if vocab < 65536 else np.int32
    train_stream = corpus.encode_files(tok, [t for _, t in train], dtype)
    held_stream = corpus.encode_files(tok, [t for _, t in held], dtype)
    res["tokenizer"] = {"vocab": vocab, "train_tokens": int(len(train_stream)), "heldout_tokens": int(len(held_stream)),
                        "s": time.perf_counter() - t0}
    log(f"tokenizer: {vocab} tokens; {len(train_stream) / 1e6:.1f}M training tokens, {len(held_stream) / 1e6:.2f}M "
        f"held out ({res['tokenizer']['s']:.0f}s)")
    bos = tok.token_to_id(corpus.BOS)
    eos_ids = [tok.token_to_id(corpus.EOS), tok.token_to_id(corpus.END)]
    max_pos = 2 * args.seq_len

    def cfg_of(shape):
        return rt.hf_config(shape, vocab, max_pos, bos, eos_ids)

    models = {}
    for role in ("target", "draft"):
        data = rt.Windows(train_stream, args.seq_len, args.seed + (role == "draft"))
        if role == "target":
            probe = rt.Windows(train_stream, args.seq_len, args.seed + 2)  # the timing's draws leave data's alone
            name, shape = pick_target_shape(args, cfg_of, probe, device)
            spec = rt.TrainSpec(shape, args.seq_len, args.batch, 3e-3 if args.tiny else 1e-3, args.target_minutes,
                                args.target_steps, seed=args.seed, compile=args.compile, warmup=10 if args.tiny else 50)
        else:
            name, shape = ("tiny", rt.TINY_DRAFT) if args.tiny else ("draft", rt.DRAFT_SHAPE)
            spec = rt.TrainSpec(shape, args.seq_len, args.batch, 2e-3, args.draft_minutes, args.draft_steps,
                                seed=args.seed, compile=args.compile, warmup=10 if args.tiny else 50)
        model = rt.build_model(cfg_of(shape), args.seed + (role == "draft"), device)
        params = rt.count_params(model)
        log(f"{role} ({name}): {params / 1e6:.1f}M parameters {shape}")
        figs = rt.train(model, data, spec, device, role)
        figs["heldout_loss"] = rt.heldout_loss(model, held_stream, args.seq_len, args.eval_windows, device)
        if not np.isfinite(figs["heldout_loss"]):  # the checks and bench.spec would only measure NaN weights
            raise RuntimeError(f"{role}: held-out loss {figs['heldout_loss']} after training; losses {figs['losses']}")
        figs.update(shape_name=name, shape=shape, params=params)
        log(f"{role}: {figs['steps']} steps, {figs['tokens'] / 1e6:.1f}M tokens in {figs['train_s']:.0f}s; held-out "
            f"loss {figs['heldout_loss']:.3f}")
        path = os.path.join(out, role)
        rt.save_checkpoint(model, path, eos_ids, bos)
        corpus.save_tokenizer(tok, path, max_pos)
        models[role] = figs
        del model
        _free(device == "cuda")
    res["models"] = models
    res["heldout_windows"] = rt.heldout_windows(held_stream, args.seq_len, args.eval_windows)
    res["train_total_s"] = time.perf_counter() - t_start
    return res


# ---------------------------------------------------------------- checks through the engine
def _engine(path: str, cuda: bool, max_reqs: int, **config):
    from shared.engine.config import EngineConfig
    from shared.engine.engine_loop import Engine
    from shared.tokenizer import Tokenizer

    ec = EngineConfig(model_path=path, max_total_tokens=200_000 if cuda else 20_000, max_running_requests=max_reqs,
                      cuda_graph=cuda, cuda_graph_max_bs=max_reqs, **config)
    return Engine(ec, Tokenizer.load(path), on_output=lambda o: None)


def engine_vs_transformers(path: str, prompts: list[list[int]], new_tokens: int, cuda: bool) -> dict:
    """Our engine's greedy tokens and logprobs against transformers' forward over the same tokens (teacher-forced:
    every position compared at the same inputs), and transformers' own greedy generate as a cross-check."""
    from transformers import LlamaForCausalLM

    eng = _engine(path, cuda, max(8, len(prompts)))
    try:
        st = drive(eng, prompts, {**GREEDY, "max_new_tokens": new_tokens}, request={"return_logprob": True})
    finally:
        eng.stop()
    del eng
    _free(cuda)
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = LlamaForCausalLM.from_pretrained(path, dtype=dtype).to("cuda" if cuda else "cpu").eval()
    hf.generation_config.eos_token_id = None
    margins, diffs, same_generate, first_diff = [], [], 0, []
    with torch.no_grad():
        for p, o in zip(prompts, st.ordered):
            toks = list(o.token_ids)
            ids = torch.tensor([p + toks], device=hf.device)
            lp = torch.log_softmax(hf(ids).logits[0, len(p) - 1:-1].float(), dim=-1)
            mine = lp.gather(1, torch.tensor(toks, device=lp.device)[:, None]).squeeze(1)
            margins.append(float((lp.max(-1).values - mine).max()))
            eng_lp = torch.tensor([e[0] for e in o.output_logprobs], device=lp.device)
            diffs.append(float((eng_lp - mine).abs().mean()))
            gen = hf.generate(torch.tensor([p], device=hf.device), do_sample=False, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=0)[0, len(p):].tolist()
            same_generate += gen == toks
            first_diff.append(next((i for i, (a, b) in enumerate(zip(gen, toks)) if a != b), None))
    del hf
    _free(cuda)
    tol_margin, tol_diff = PARITY_TOL[dtype]
    return {"dtype": str(dtype), "prompts": len(prompts), "new_tokens": new_tokens, "max_argmax_gap": max(margins),
            "mean_abs_logprob_diff": float(np.mean(diffs)), "max_abs_logprob_diff_mean": max(diffs),
            "same_as_generate": same_generate, "generate_first_diff": first_diff,
            "tolerance": [tol_margin, tol_diff],
            "pass": max(margins) <= tol_margin and float(np.mean(diffs)) <= tol_diff}


def engine_heldout_loss(path: str, windows: list[list[int]], cuda: bool, quantization: str) -> float:
    """Mean negative logprob of every held-out window's tokens after its first, from the engine's prompt logprobs."""
    eng = _engine(path, cuda, 32, quantization=quantization)
    try:
        st = drive(eng, windows, {**GREEDY, "max_new_tokens": 1}, request={"return_logprob": True,
                                                                          "logprob_start_len": 0})
    finally:
        eng.stop()
    del eng
    _free(cuda)
    lps = [e[0] for o in st.ordered for e in o.input_logprobs if e[0] is not None]
    return -float(np.mean(lps))


def run_checks(out: str, manifest: dict, cuda: bool, parity_prompts: int, parity_tokens: int) -> dict:
    tok = _hf_tokenizer(out)
    held = read_heldout(out)
    prompts = corpus.code_prompts(tok, held, parity_prompts, 128 if cuda else 24, parity_tokens)
    checks: dict = {}
    for role in ("target", "draft"):
        log(f"engine vs transformers: {role}")
        checks[f"parity_{role}"] = engine_vs_transformers(os.path.join(out, role), prompts, parity_tokens, cuda)
        log(f"  {checks[f'parity_{role}']}")
    windows = manifest["heldout_windows"]
    for q in ("none", "fp8"):
        log(f"engine held-out loss, quantization {q}")
        checks[f"engine_loss_{q}"] = engine_heldout_loss(os.path.join(out, "target"), windows, cuda, q)
        log(f"  {checks[f'engine_loss_{q}']:.4f}")
    checks["fp8_loss_ratio"] = checks["engine_loss_fp8"] / checks["engine_loss_none"]
    return checks


def _hf_tokenizer(out: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(out, "target", "tokenizer.json"))


def report(m: dict) -> list[str]:
    """The run's PASS/FAIL and info lines."""
    lines = [f"{m['device']}: settings {m['settings']['hash']}, trained in {m['train_total_s']:.0f}s"]
    for role, f in m["models"].items():
        lines.append(f"info  {role} {f['shape_name']} {f['params'] / 1e6:.1f}M params, {f['steps']} steps "
                     f"({f['tokens'] / 1e6:.1f}M tokens, {f['train_s']:.0f}s): held-out loss {f['heldout_loss']:.3f}")
    tgt, drf = m["models"]["target"]["heldout_loss"], m["models"]["draft"]["heldout_loss"]
    lines.append(f"{'PASS' if tgt < drf else 'FAIL'}  the target's held-out loss {tgt:.3f} is below the draft's "
                 f"{drf:.3f} (both learned: a uniform guess is {np.log(m['tokenizer']['vocab']):.2f})")
    c = m.get("checks")
    if not c:
        lines.append("info  checks skipped (--skip-checks)")
        return lines
    if "error" in c:
        lines.append(f"FAIL  the checks through the engine failed: {c['error']}")
        return lines
    for role in ("target", "draft"):
        p = c[f"parity_{role}"]
        lines.append(f"{'PASS' if p['pass'] else 'FAIL'}  engine vs transformers ({role}, {p['dtype']}, {p['prompts']} "
                     f"held-out prompts x {p['new_tokens']} greedy tokens): largest gap to transformers' argmax "
                     f"{p['max_argmax_gap']:.2g} (tol {p['tolerance'][0]}), mean |logprob diff| "
                     f"{p['mean_abs_logprob_diff']:.2g} (tol {p['tolerance'][1]}); transformers' generate gave the "
                     f"same tokens on {p['same_as_generate']}/{p['prompts']}")
    r = c["fp8_loss_ratio"]
    lines.append(f"{'PASS' if r <= GOAL_FP8_LOSS else 'FAIL'}  FP8 held-out loss {c['engine_loss_fp8']:.4f} = {r:.4f}x "
                 f"bf16's {c['engine_loss_none']:.4f} through the engine (goal <= {GOAL_FP8_LOSS}; training-side "
                 f"loss {tgt:.4f})")
    return lines


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.reference_models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/refmodels", help="checkpoint directory (reused when finished)")
    ap.add_argument("--results", default=os.environ.get("OUT"), help="also write reference_models.json here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a few MB of text, tiny models, fixed steps: seconds on a CPU")
    ap.add_argument("--target-minutes", type=float, default=3.5)
    ap.add_argument("--draft-minutes", type=float, default=1.0)
    ap.add_argument("--target-shape", default="auto", choices=["auto", *rt.TARGET_LADDER],
                    help="auto: the largest that sees --min-tokens-per-param in the budget at the measured rate")
    ap.add_argument("--target-steps", type=int, default=0, help="fixed step count (0: fit the budget)")
    ap.add_argument("--draft-steps", type=int, default=0)
    ap.add_argument("--min-tokens-per-param", type=float, default=0.08)
    ap.add_argument("--vocab", type=int, default=None, help="tokenizer vocabulary (16384; tiny 512)")
    ap.add_argument("--tokenizer-mb", type=float, default=24.0, help="training text the tokenizer learns from")
    ap.add_argument("--seq-len", type=int, default=None, help="packed window (1024; tiny 64)")
    ap.add_argument("--batch", type=int, default=None, help="windows a step (32; tiny 8)")
    ap.add_argument("--max-mb", type=float, default=None, help="training text (160; tiny 2)")
    ap.add_argument("--heldout-permille", type=int, default=None, help="files held out (20; tiny 100)")
    ap.add_argument("--eval-windows", type=int, default=None, help="held-out windows of the losses (48; tiny 4)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the training step")
    ap.add_argument("--parity-prompts", type=int, default=None, help="(8; tiny 3)")
    ap.add_argument("--parity-tokens", type=int, default=None, help="(32; tiny 8)")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--force", action="store_true", help="train again even if --out holds a finished run")
    args = ap.parse_args(argv)
    defaults = dict(vocab=(16384, 512), seq_len=(1024, 64), batch=(32, 8), max_mb=(160.0, 1.0),
                    heldout_permille=(20, 100), eval_windows=(48, 4), parity_prompts=(8, 3), parity_tokens=(32, 8))
    for k, (full, tiny) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, tiny if args.tiny else full)
    if args.tiny:
        args.target_steps = args.target_steps or 40
        args.draft_steps = args.draft_steps or 30
        args.tokenizer_mb = min(args.tokenizer_mb, args.max_mb)
    return args


def ensure(args) -> dict:
    """The finished run of these settings in args.out: reused, or trained and checked now (a run whose checks did not
    finish, in a call cut short, is checked without training again)."""
    want = settings(args)
    m = None if args.force else finished_manifest(args.out, want["hash"])
    if m is not None:
        log(f"{args.out} holds a finished run of these settings ({want['hash']}): reused")
        return m
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if args.tiny and not cuda:
        torch.set_num_threads(1)  # tiny tensors: threads only contend (20x slower on a busy 2-core machine)
    m = None if args.force else finished_manifest(args.out, want["hash"], trained_only=True)
    if m is None:
        torch.manual_seed(args.seed)
        shutil.rmtree(args.out, ignore_errors=True)
        os.makedirs(args.out)
        m = train_all(args, args.out, device)
        m["trained"] = True
        write_manifest(args.out, m)
    else:
        log(f"{args.out} holds the trained models of these settings ({want['hash']}): checking them")
    if not args.skip_checks:
        try:
            m["checks"] = run_checks(args.out, m, cuda, args.parity_prompts, args.parity_tokens)
        except Exception as e:  # the models stand: bench.spec may run on them; the report says FAIL
            import traceback

            traceback.print_exc()
            m["checks"] = {"error": repr(e)[:500]}
    m["finished"] = True
    write_manifest(args.out, m)
    return m


def main(argv=None) -> int:
    args = parse_args(argv)
    m = ensure(args)
    lines = report(m)
    if args.results:
        os.makedirs(args.results, exist_ok=True)
        with open(os.path.join(args.results, "reference_models.json"), "w") as f:
            json.dump({k: v for k, v in m.items() if k != "heldout_windows"}, f, indent=1)
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
