"""Synthetic data with fixed seeds: pseudo-English text of a requested length in words.

No data set is downloaded: each workload builds its inputs here, with lengths chosen to give prompts and
outputs of the original benchmarks' shape (see bench/workloads/README.md). A word is about 1.3 tokens with
a real BPE tokenizer; lengths below are in words and scale with the driver's --scale.
"""
from __future__ import annotations

import random

_WORDS = ("time year people way day man thing woman life child world school state family student group "
          "country problem hand part place case week company system program question work government number "
          "night point home water room mother area money story fact month lot right study book eye job word "
          "business issue side kind head house service friend father power hour game line end member law car "
          "city community name president team minute idea kid body information back parent face others level "
          "office door health person art war history party result change morning reason research girl guy "
          "moment air teacher force education river market energy forest garden bridge engine signal theory "
          "planet island village harbor winter summer storm light stone metal paper glass music picture").split()


def rng_for(*key) -> random.Random:
    return random.Random(":".join(str(k) for k in key))


def words(rng: random.Random, n: int) -> str:
    """n pseudo-English words in sentences of 6 to 16 words."""
    out, left = [], max(1, int(n))
    while left > 0:
        k = min(left, rng.randint(6, 16))
        sentence = " ".join(rng.choice(_WORDS) for _ in range(k))
        out.append(sentence[0].upper() + sentence[1:] + ".")
        left -= k
    return " ".join(out)


def length(rng: random.Random, mean: float, spread: float = 0.3, scale: float = 1.0) -> int:
    """A length around mean*scale (uniform within +-spread), at least 1."""
    return max(1, int(mean * scale * rng.uniform(1 - spread, 1 + spread)))


def label(rng: random.Random) -> str:
    return rng.choice("ABCD")
