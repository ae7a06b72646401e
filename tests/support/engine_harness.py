"""Run the real engine (tiny-random model) synchronously in the test thread."""
from __future__ import annotations

import itertools

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.protocol import GenerateRequest, TokenOutput
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

_rid = itertools.count()
_TOKENIZER = None


def tokenizer() -> Tokenizer:
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = Tokenizer.load("tiny-random")
    return _TOKENIZER


class Harness:
    def __init__(self, **cfg):
        # Engine logic under test, not bf16 numerics: fp32 everywhere, and a fixed pool so several
        # engines fit on one GPU.
        cfg.setdefault("dtype", "float32")
        cfg.setdefault("max_total_tokens", 65536)
        self.outputs: dict[str, list[TokenOutput]] = {}
        self.engine = Engine(EngineConfig(**cfg), tokenizer(), self._collect)

    def _collect(self, outs):
        for o in outs:
            self.outputs.setdefault(o.rid, []).append(o)

    def submit(self, input_ids, rid=None, **kw) -> str:
        rid = rid or f"t{next(_rid)}"
        # Not validated here: the engine's own check (what a worker runs on every frame) is under test too.
        sampling = SamplingParams(**kw.pop("sampling", {}))
        self.engine.submit(GenerateRequest(rid=rid, input_ids=list(input_ids), sampling=sampling, **kw))
        return rid

    def done(self, rid) -> bool:
        return any(o.finished for o in self.outputs.get(rid, []))

    def run(self, rids, max_steps=10_000):
        for _ in range(max_steps):
            if all(self.done(r) for r in rids):
                return [self.result(r) for r in rids]
            self.engine.step()
        raise AssertionError("requests did not finish")

    def result(self, rid) -> dict:
        outs = self.outputs[rid]
        last = outs[-1]
        return {
            "ids": [t for o in outs for t in o.token_ids],
            "text": "".join(o.text for o in outs),
            "finish": None if last.finish_reason is None else last.finish_reason.to_json(),  # meta_info's shape
            "cached": last.cached_tokens,
            "prompt_tokens": last.prompt_tokens,
            "logprobs": [e for o in outs for e in o.output_logprobs],
            "top": [e for o in outs for e in o.output_top_logprobs],
            "input_logprobs": [e for o in outs for e in o.input_logprobs],
            "input_top": [e for o in outs for e in o.input_top_logprobs],
            "error": last.error,
            "chunks": len(outs),
        }

    def generate(self, input_ids, **kw) -> dict:
        return self.run([self.submit(input_ids, **kw)])[0]

    def free_tokens(self) -> int:
        e = self.engine
        return e.allocator.available_size() + e.cache.evictable_size()
