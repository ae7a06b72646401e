"""A hub id loads through the same code as a directory: here from a pre-populated local HF cache with
the hub offline (no downloads on these machines), exactly as a real deployment reads a warm cache."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.support.stack import ROOT

SCRIPT = r"""
import os, shutil, torch
from shared.models.tiny_random import save_tiny_random_checkpoint
from shared.models.loader import load_model
from shared.tokenizer import Tokenizer

cache = os.environ["HF_HUB_CACHE"]
snap = os.path.join(cache, "models--acme--tiny-llama", "snapshots", "0123456789abcdef0123456789abcdef01234567")
save_tiny_random_checkpoint(snap)
os.makedirs(os.path.join(cache, "models--acme--tiny-llama", "refs"), exist_ok=True)
with open(os.path.join(cache, "models--acme--tiny-llama", "refs", "main"), "w") as f:
    f.write("0123456789abcdef0123456789abcdef01234567")
model, cfg = load_model("acme/tiny-llama")
ref, _ = load_model("tiny-random")
for (n, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
    assert torch.equal(a, b), n
tok = Tokenizer.load("acme/tiny-llama")
assert tok.encode("hello world") == Tokenizer.load("tiny-random").encode("hello world")
print("ok")
"""


def test_hub_id_loads_from_the_local_cache_offline(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
