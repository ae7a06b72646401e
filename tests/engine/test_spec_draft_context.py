"""STANDALONE with a draft model of a shorter context than the target's: the draft's request table is only that wide,
so a request drafts while its round stays inside it and then decodes on without drafts (a column past the table
indexed out of bounds: an error here, a device-side assert on a GPU)."""
from __future__ import annotations

import json
import os

from safetensors.torch import save_file

from shared.models.tiny_random import tiny_random_config, tiny_random_state_dict
from shared.tokenizer import save_tiny_tokenizer
from tests.support.engine_harness import Harness


def test_a_draft_of_a_shorter_context_drafts_inside_it(tmp_path):
    path = str(tmp_path)
    cfg = tiny_random_config()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(cfg.to_hf(), max_position_embeddings=48), f)
    save_file(tiny_random_state_dict(cfg), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    save_tiny_tokenizer(path)
    prompt, sampling = [20, 21, 22, 23] * 10, {"temperature": 0, "max_new_tokens": 16}
    want = Harness().generate(prompt, sampling=sampling)
    spec = Harness(speculative_algorithm="STANDALONE", speculative_draft_model_path=path)
    assert spec.engine.spec.runner.max_context_len == 48 < spec.engine.runner.max_context_len
    got = spec.generate(prompt, sampling=sampling)
    assert got["error"] is None and got["ids"] == want["ids"]
    stats = spec.engine.spec.stats
    assert stats.proposed > 0 and stats.accepted == stats.proposed  # the same weights: every draft kept
    draft = spec.engine.spec
    assert draft.allocator.available_size() == draft.allocator.total_size()
