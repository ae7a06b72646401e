"""Speculative decoding: a speculator proposes draft tokens for running requests; the engine appends them as
proposals, the next pass extends them (one target pass over each request's last token and its drafts,
sampled at every position) and keeps the longest prefix the target sampled itself, then the target's own
next token (shared/engine/engine_loop.py, `_take_verified`).

Drafts are deterministic (a lookup, or the draft model's argmax), so a draft x is accepted exactly when the
target's sample at its position is x: with probability p(x), and on a reject the target's sample is a draw
from p conditioned on not x, i.e. the rejection-sampling rule for a one-hot draft distribution. The sampler's
draws are a function of (seed, step, token), so the output is the very tokens decoding without speculation
would give, greedy or not."""
from __future__ import annotations

from dataclasses import dataclass

from shared.engine.config import EngineConfig
from shared.engine.request import Req

ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE")
_NGRAM_DRAFT_TOKENS = 8
_STANDALONE_STEPS = 3


class SpecConfigError(ValueError):
    """Speculation flags that cannot work (or together): refused at start."""


def spec_config_error(config: EngineConfig) -> str | None:
    """What is wrong with the speculation flags on their own (no model loaded), or None."""
    algo = config.speculative_algorithm
    draft = config.speculative_draft_model_path
    if algo is None:
        if draft is not None:
            return "--speculative-draft-model-path needs --speculative-algorithm STANDALONE"
        return None
    if algo not in ALGORITHMS:
        return f"--speculative-algorithm must be one of {', '.join(ALGORITHMS)}, got {algo!r}"
    if algo == "EAGLE":
        return ("--speculative-algorithm EAGLE is not implemented in this server (it needs an EAGLE head "
                "trained for the target); use NGRAM or STANDALONE")
    if algo == "NGRAM":
        if draft is not None:
            return "--speculative-algorithm NGRAM uses no draft model: drop --speculative-draft-model-path"
        if config.speculative_ngram_min_match_window_size > config.speculative_ngram_max_match_window_size:
            return ("--speculative-ngram-min-match-window-size must not exceed "
                    "--speculative-ngram-max-match-window-size")
    if algo == "STANDALONE":
        if draft is None:
            return "--speculative-algorithm STANDALONE needs --speculative-draft-model-path"
        steps, tokens = config.speculative_num_steps, config.speculative_num_draft_tokens
        if steps is not None and tokens is not None and tokens != steps + 1:
            return ("STANDALONE drafts a chain: --speculative-num-draft-tokens must be "
                    f"--speculative-num-steps + 1 ({steps + 1}), got {tokens}")
    return None


def num_drafts(config: EngineConfig) -> int:
    """Draft tokens a request proposes a round at most."""
    if config.speculative_algorithm == "STANDALONE":
        if config.speculative_num_steps is not None:
            return config.speculative_num_steps
        if config.speculative_num_draft_tokens is not None:
            return config.speculative_num_draft_tokens - 1
        return _STANDALONE_STEPS
    return (config.speculative_num_draft_tokens or _NGRAM_DRAFT_TOKENS) - 1


@dataclass
class SpecStats:
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of them, kept
    verifications: int = 0  # request-rows of verification passes (each yields accepted + 1 tokens)
    grammar_cut: int = 0  # drafts of constrained requests cut before verification: their grammar refused them

    def as_dict(self) -> dict:
        v = self.verifications
        return {"proposed": self.proposed, "accepted": self.accepted, "verifications": v,
                "grammar_cut": self.grammar_cut,
                "accept_rate": round(self.accepted / self.proposed, 6) if self.proposed else 0.0,
                # SGLang's accept length: tokens gained a verification, the target's own one included.
                "mean_accept_length": round((self.accepted + v) / v, 6) if v else 0.0}


class Speculator:
    """Proposes drafts for a step's running requests. Subclasses: NgramSpeculator, DraftModelSpeculator."""

    algorithm = ""

    def __init__(self, config: EngineConfig):
        self.k = num_drafts(config)
        self.disable_batch_size = config.speculative_disable_batch_size
        self.stats = SpecStats()

    def drafts_for(self, batch_size: int) -> int:
        """Drafts a request proposes at this running batch size (0: speculation is off for it)."""
        limit = self.disable_batch_size
        if limit <= 0 or batch_size <= max(1, limit // 4):
            return self.k
        return max(1, self.k // 2) if batch_size <= limit else 0

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        """Up to budgets[i] drafts for each request (their confirmed tokens are req.all_ids[:seq_len])."""
        raise NotImplementedError

    def filled_masks(self, req: Req) -> list | None:
        """The grammar mask rows (host int32) `req`'s drafts just proposed were sampled under, one a draft
        from the first (None: none, as for NGRAM's lookups); handed once, verification fills only the rest."""
        return None

    def verified(self, req: Req, kept: int) -> None:
        """`req`'s drafts were verified: `kept` of them stayed (a draft model rolls back the rest)."""

    def release(self, req: Req) -> None:
        """`req` ended or left: drop its state."""
        req.spec_state = None

    def info(self) -> dict:
        return {"algorithm": self.algorithm, "num_draft_tokens": self.k + 1,
                "disable_batch_size": self.disable_batch_size, **self.stats.as_dict()}

    def close(self) -> None:
        pass


class NgramSpeculator(Speculator):
    algorithm = "NGRAM"

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.lo = config.speculative_ngram_min_match_window_size
        self.hi = config.speculative_ngram_max_match_window_size

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        from shared.engine.spec.ngram import NgramIndex

        drafts = []
        for req, k in zip(reqs, budgets):
            index = req.spec_state
            if index is None:
                index = req.spec_state = NgramIndex(self.lo, self.hi)
            index.sync(req.input_ids, req.output_ids, req.num_resolved)
            drafts.append(index.propose(k))
        return drafts


def build_speculator(config: EngineConfig, runner, tokenizer) -> Speculator | None:
    """The configured speculator (None: off); raises SpecConfigError for flags that cannot work."""
    error = spec_config_error(config)
    if error:
        raise SpecConfigError(error)
    if config.speculative_algorithm is None:
        return None
    if config.speculative_algorithm == "NGRAM":
        return NgramSpeculator(config)
    from shared.engine.spec.draft import DraftModelSpeculator

    return DraftModelSpeculator(config, runner, tokenizer)
