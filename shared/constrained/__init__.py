"""Grammar-constrained decoding (regex, JSON schema, json_object, EBNF) on xgrammar, with
jump-forward over forced text. The engine uses:

    cache = GrammarCache(tokenizer, model_vocab_size)      # once per process
    state = cache.new_state(cache.compile(kind, text))     # per request (or poll cache.submit())
    mask = MaskBuilder(V).build(states, device)            # per step, None if no grammar
    state.accept_token(tok); jump_forward(state, out_ids, tokenizer)   # after sampling
    (or plan_jump for several requests, then apply_jump for those worth an extend pass)
"""
from shared.constrained.bitmask import GrammarMask, MaskBuilder, apply_bitmask, bitmask_to_bool, set_allowed
from shared.constrained.grammar_cache import KINDS, GrammarCache
from shared.constrained.jump_forward import (JumpForward, RetokenizeMemo, apply_jump, forced_text, jump_forward,
                                             plan_jump)
from shared.constrained.matcher import GrammarState
from shared.constrained.vocab import VocabIndex, build_tokenizer_info

__all__ = [
    "GrammarCache", "GrammarState", "GrammarMask", "MaskBuilder", "JumpForward", "KINDS", "RetokenizeMemo",
    "VocabIndex",
    "apply_bitmask", "bitmask_to_bool", "build_tokenizer_info", "jump_forward",
    "apply_jump", "forced_text", "plan_jump", "set_allowed",
]
