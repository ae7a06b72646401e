"""One object per request: its tokens, its place in the KV pool, and what it has reported so far."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from shared.protocol import FinishReason, Transfer, wants_input_logprobs
from shared.sampling_params import SamplingParams


# An output slot whose token was sampled on the device but has not reached the host yet (overlap
# scheduling, or a first token announced before its value is recorded).
PENDING_TOKEN = -1


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    cache_salt: str | None = None
    stream: bool = True
    # PD mode: GenerateRequest.transfer (role prefill|decode, id...); None for local work.
    transfer: Transfer | None = None
    kv_offered: bool = False  # decode side: the prefill worker has committed to this prompt (its header came)
    arrival_time: float = field(default_factory=time.monotonic)

    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Output tokens whose values are known on the host. With overlap scheduling the last one or two
    # entries of output_ids may be placeholders for tokens still on the device.
    num_resolved: int = 0
    # KV state (valid while RUNNING): row in req_to_token, tokens whose KV is in the pool, the prefix that
    # came from the cache (locked through last_node), and the page-aligned length inserted so far.
    req_pool_idx: int | None = None
    kv_len: int = 0
    cached_len: int = 0
    last_node: Any = None
    slots: list[int] = field(default_factory=list)  # pool slot of every position with KV (host mirror)
    # Leading entries of the request's req_to_token row written by passes since the row was taken (an
    # extend pass writes only past them: a catch-up pass need not rewrite whole rows). 0 on a new row.
    table_len: int = 0
    # Reported: prefix tokens served from the cache at first admission (counted once).
    num_cached_tokens: int | None = None
    first_scheduled_time: float | None = None
    skipped_rounds: int = 0  # admission rounds this request was passed over (aging)
    sibling_deferrals: int = 0  # rounds it waited for a sibling computing the same tokens (prefill_adder)
    lpm_memo: Any = None  # (match key length, the cache's memo) from the last LPM ordering
    host_load: Any = None  # host tier: the load-back of its prefix it waits on (HiRadixCache.load_back)
    host_load_failed: bool = False  # its load failed or timed out: it recomputes that prefix, never loads it again
    retractions: int = 0
    # Fault isolation: engine steps that failed with this request in the batch, and whether its next
    # pass must run alone (after a failed step, each request is re-run solo to find the one at fault).
    step_failures: int = 0
    solo: bool = False
    finish_reason: FinishReason | None = None
    # Per-request helpers owned by the engine: detokenizer state, grammar state.
    detok: Any = None
    grammar: Any = None
    grammar_future: Any = None
    # Jump-forward in verify mode: trailing output tokens proposed by the grammar, not yet confirmed
    # by the model, and the allowed-token bitmask at each proposal position and after the last.
    proposed: int = 0
    proposal_masks: Any = None
    # Speculative decoding (shared/engine/spec/): the proposals are drafts, the speculator's per-request state
    # (an n-gram index, a draft model's KV row), and the verification passes this request went through.
    drafted: bool = False
    spec_state: Any = None
    spec_verify_ct: int = 0
    # Logprobs not yet sent.
    pending_output_logprobs: list = field(default_factory=list)
    pending_output_top_logprobs: list = field(default_factory=list)
    input_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    input_logprobs_sent: bool = False
    sent_token_count: int = 0
    pending_text: str = ""

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def transfer_role(self) -> str | None:
        return self.transfer.role if self.transfer else None

    @property
    def transfer_id(self) -> str | None:
        return self.transfer.id if self.transfer else None

    @property
    def wants_input_logprobs(self) -> bool:
        return wants_input_logprobs(self.return_logprob, self.logprob_start_len, len(self.input_ids))

    def drop_proposals(self) -> None:
        """Forget unverified proposals (jump-forward's or drafts; their grammar progress too)."""
        if self.proposed:
            if self.grammar is not None:
                self.grammar.rollback(self.proposed)
            # Proposals follow the resolved tokens; a placeholder after them (a pass in flight) goes too.
            del self.output_ids[self.num_resolved:]
            self.proposed, self.proposal_masks, self.drafted = 0, None, False

    def remaining_new_tokens(self) -> int:
        return max(0, self.params.max_new_tokens - len(self.output_ids))
