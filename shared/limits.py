"""What one request may ask for, defined once. The gateway refuses more with a 400 before any work; the
worker checks the same numbers again where the work happens (a frame on its port may not have come
through a gateway, or through this version of it)."""
from __future__ import annotations

MAX_N = 16  # choices per request (the gateway's --max-n default)
MAX_TOP_LOGPROBS = 20  # alternatives per position
MAX_RID_LEN = 128
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256  # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 4096  # entries
MAX_GRAMMAR_CHARS = 256 * 1024  # one regex / JSON schema / EBNF grammar
MAX_REPEAT = 100_000  # a count in a grammar ({n} / {n,m}, minLength, maxItems...): bounds forced runs
