"""What every route needs, in one dataclass built once at start-up."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.gateway.cpu_work import CpuWork
from services.gateway.routing.dispatch import Dispatcher
from services.gateway.routing.health import HealthMonitor
from services.gateway.limits import Limits
from services.gateway.http.metrics import GatewayMetrics
from services.gateway.programs.limits import ProgramBudget, ProgramSlots
from services.gateway.routing.router import Router
from shared.tokenizer import Tokenizer

if TYPE_CHECKING:
    from shared.constrained import GrammarCache


@dataclass
class GatewayState:
    tokenizer: Tokenizer
    served_model_name: str
    model_path: str
    router: Router
    # None until a worker reports it (the health probe fills it in); context checks wait for it.
    context_length: int | None = None
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    admin_api_key: str | None = None
    tokenizer_path: str | None = None
    # Output parsers of /v1/chat/completions (services/gateway/api/tool_parsers.py, reasoning.py); None: off.
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    metrics: GatewayMetrics = field(init=False)
    dispatcher: Dispatcher = field(init=False)
    health: HealthMonitor = field(init=False)
    grammars: "GrammarCache" = field(init=False)
    cpu: CpuWork = field(init=False)
    program_budget: ProgramBudget = field(default_factory=ProgramBudget)
    program_slots: ProgramSlots = field(init=False)
    # The program endpoint's fork prefix hint: one prefill of a fork's shared prefix before its branches.
    fork_hint: bool = True
    # Set on SIGTERM: /health answers 503 so load balancers stop sending, while requests still finish.
    draining: bool = False
    drain_grace: float = 1.0
    # (index, count): this process's place in a --gateway-processes pool ((0, 1) alone)
    process: tuple[int, int] = (0, 1)

    def __post_init__(self):
        from shared.constrained import GrammarCache

        # Validation only (workers compile their own): the tokenizer's vocabulary suffices.
        self.grammars = GrammarCache(self.tokenizer)
        self.program_slots = ProgramSlots(self.program_budget)
        self.cpu = CpuWork(self.tokenizer, self.tokenizer_path or self.model_path)
        self.metrics = GatewayMetrics(self.served_model_name)
        self.dispatcher = Dispatcher(self.router, self.metrics)
        self.health = HealthMonitor(self.router, self.tokenizer, on_context_length=self._learn_context_length)

    def _learn_context_length(self, n: int) -> None:
        """The first worker's max_context_len, unless --context-length gave it."""
        if self.context_length is None:
            self.context_length = n

    @property
    def api_keys(self) -> list[str]:
        """--api-key takes one key or a comma-separated list; each key is its own tenant."""
        return [k.strip() for k in (self.api_key or "").split(",") if k.strip()]

    def model_names(self) -> set[str]:
        return {self.served_model_name, self.model_path}
