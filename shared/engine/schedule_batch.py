"""What the scheduler hands the model runner for one pass: the requests, their token counts, the new
tokens' KV slots (one definition for scheduler, admission, runner and engine)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.models.forward_batch import ForwardMode
from shared.engine.request import Req


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    sample: list[bool]  # False: a prefill chunk that stops short of the sequence end (no token sampled)
    input_ids: list[int]
    out_cache_loc: torch.Tensor  # host int64
    # Decode: groups of requests whose KV begins with one cached prefix (prefix length, batch indices),
    # for shared-prefix attention; None when not looked for.
    prefix_groups: list[tuple[int, list[int]]] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.reqs)
