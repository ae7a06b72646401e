"""bench.reference_models --tiny on the CPU: this interpreter's sources split by path hash, a BPE tokenizer with a chat
template, a target and a draft trained and written as HF checkpoints that our loader and transformers both load
with the same greedy tokens, the engine checks run, and a second run of the same settings reuses the directory."""
import json
import os

import pytest
import torch

from bench import reference_corpus as corpus
from bench import reference_models


def test_tiny_run_writes_checkpoints_both_loaders_agree_on(tiny_refmodels, capsys):
    out, argv, printed = tiny_refmodels
    m = json.loads(open(os.path.join(out, "manifest.json")).read())
    assert m["finished"] and "FAIL" not in printed and printed.count("PASS") == 4, printed
    assert 0.99 < m["checks"]["fp8_loss_ratio"] < 1.01
    assert m["models"]["target"]["heldout_loss"] < m["models"]["draft"]["heldout_loss"] < 6.3  # ln 512 = 6.24
    held = open(os.path.join(out, "heldout.txt")).read().split()
    assert held and all(corpus.held_out(rel, 100) for rel in held)
    assert m["corpus"]["train_files"] > 10
    assert os.path.exists(os.path.join(os.path.dirname(out), "results", "reference_models.json"))

    from transformers import LlamaForCausalLM

    from shared.models.loader import load_model
    from shared.tokenizer import Tokenizer
    from tests.support.hf_models import paged_greedy
    for role in ("target", "draft"):
        path = os.path.join(out, role)
        tok = Tokenizer.load(path)
        assert tok.eos_token_ids == [1, 2] and tok.bos_token_id == 0
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
        assert text == "<|bos|><|user|>\nhi<|end|>\n<|assistant|>\n"
        ours, cfg = load_model(path)
        hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompt = tok.encode("def main():\n    return")
        got = paged_greedy(ours, cfg, [prompt], 6)[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=7, min_new_tokens=7,
                              eos_token_id=None, pad_token_id=0)
        assert got == ref[0, len(prompt):].tolist()

    assert reference_models.main(argv) == 0  # the same settings: reused, not trained again
    assert "holds a finished run of these settings" in capsys.readouterr().out
    assert reference_models.finished_manifest(out, "another-hash") is None


def test_held_out_split_is_by_path_hash_and_prose_cuts_land_in_prose():
    """The split depends on the relative path alone; cuts fall inside long docstrings and comment blocks."""
    assert corpus.held_out("stdlib/os.py", 20) == corpus.held_out("stdlib/os.py", 20)
    share = sum(corpus.held_out(f"stdlib/m{i}.py", 20) for i in range(5000)) / 5000
    assert 0.01 < share < 0.03
    doc = "x " * 150
    text = f'"""{doc}"""\nimport os\n\n' + "".join(f"# {'c' * 90}\n" for _ in range(3)) + "y = 1\n# short\n"
    cuts = corpus.prose_cuts(text)
    assert len(cuts) == 2
    assert 3 < cuts[0] < len(doc)
    assert text.index("# c") < cuts[1] < text.index("y = 1")


def test_a_run_cut_short_after_training_is_checked_not_trained_again(tiny_refmodels, tmp_path, capsys):
    """A manifest with the models written but no finish (the device call ended in the checks): the next run of the same
    settings keeps the models and only checks (here: skips the checks, and finishes)."""
    import shutil

    out, argv, _ = tiny_refmodels
    copy = str(tmp_path / "copy")
    shutil.copytree(out, copy)
    m = json.loads(open(os.path.join(copy, "manifest.json")).read())
    m.pop("finished")
    m.pop("checks")
    reference_models.write_manifest(copy, m)
    before = os.path.getmtime(os.path.join(copy, "target", "model.safetensors"))
    i = argv.index("--out")
    assert reference_models.main(argv[:i + 1] + [copy] + argv[i + 2:] + ["--skip-checks"]) == 0
    assert "holds the trained models of these settings" in capsys.readouterr().out
    assert os.path.getmtime(os.path.join(copy, "target", "model.safetensors")) == before
    assert reference_models.finished_manifest(copy, m["settings"]["hash"]) is not None


@pytest.mark.gpu
def test_tiny_run_on_the_gpu_trains_with_autocast_and_checks_in_bf16(tiny_refmodels):
    """The same tiny run on a GPU: trained under bf16 autocast, and the engine (CUDA graphs, Triton kernels) against
    transformers in bf16 within the bf16 tolerances, FP8 loss within 1%."""
    out, _, printed = tiny_refmodels
    m = json.loads(open(os.path.join(out, "manifest.json")).read())
    assert m["device"] != "cpu" and m["checks"]["parity_target"]["dtype"] == "torch.bfloat16"
    assert "FAIL" not in printed, printed


def test_a_step_with_non_finite_gradients_is_skipped_not_applied():
    """One batch whose gradients hold an inf must not reach the weights: clipping multiplies it by 0, a NaN in
    every weight from then on. The step is skipped, counted, and training goes on; without the check the weights
    end NaN."""
    import numpy as np

    from bench import reference_train as rt

    model = rt.build_model(rt.hf_config(rt.TINY_TARGET, 64, 64, 0, [1]), 0, "cpu")
    poisoned = {"n": 0}

    def hook(grad):  # the third backward's gradient of one weight is inf
        poisoned["n"] += 1
        return torch.full_like(grad, float("inf")) if poisoned["n"] == 3 else grad

    model.model.layers[0].mlp.down_proj.weight.register_hook(hook)
    data = rt.Windows(np.arange(4000, dtype=np.int64) % 64, 16, 0)
    figs = rt.train(model, data, rt.TrainSpec(rt.TINY_TARGET, 16, 4, 1e-3, 1.0, steps=6, warmup=2), "cpu", "t")
    assert figs["skipped_steps"] == 1 and figs["steps"] == 6
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
