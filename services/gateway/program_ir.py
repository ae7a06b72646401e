"""The server's form of a program (lang_client's IR, version 1, after validation) and its limits.

services/gateway/program_validate.py turns request JSON into these nodes; program_exec.py walks them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

IR_VERSION = 1
ROLES = ("system", "user", "assistant")
# Used when a role node carries no rendered text (the client normally sends its template's markers).
CHATML_ROLES = {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES}
SELECT_METHODS = ("token_length_normalized", "greedy_token_selection")
JOIN_MODES = ("gather_variable", "concate_and_append")
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
SCOPE_RE = re.compile(r"^(|f\d+\.\d+)$")
IF_TESTS = ("eq", "ne")
# What an if may apply to the value before comparing (the tracer's `s["x"].strip().lower() == "yes"`).
IF_TRANSFORMS = {"strip": str.strip, "lstrip": str.lstrip, "rstrip": str.rstrip, "lower": str.lower,
                 "upper": str.upper, "casefold": str.casefold}


@dataclass(frozen=True)
class ProgramLimits:
    max_nodes: int = 4096              # every node, branches included
    max_fork_width: int = 64           # n of one fork
    max_total_tokens: int = 131072     # sum of max_new_tokens over all gens (default 128 each)
    max_depth: int = 8                 # fork nesting
    max_if_depth: int = 128            # if nesting (the tracer makes at most 64 branches on one path)
    max_text_chars: int = 1_000_000    # literal text, role markers, choices, grammars and bound args
    max_choices: int = 256             # choices of one select
    max_name_chars: int = 128


# ---- the validated program ----
@dataclass
class TextNode:
    text: str


@dataclass
class RoleNode:
    role: str
    begin: bool
    text: str


@dataclass
class GenNode:
    name: str | None
    sampling_params: dict[str, Any]
    logprob: dict[str, Any] = field(default_factory=dict)  # top-level /generate logprob keys


@dataclass
class SelectNode:
    name: str | None
    choices: list[str]
    temperature: float
    method: str


@dataclass
class ForkNode:
    id: int
    branches: list[list[Any]]


@dataclass
class JoinNode:
    fork: int
    mode: str
    names: list[str] = field(default_factory=list)  # gather_variable: the names every branch defines
    maybe: list[str] = field(default_factory=list)  # ...and those only some paths define: gathered when all did


@dataclass
class VarNode:
    name: str
    scope: str
    def_index: int  # which definition of (scope, name) this read sees, fixed at validation


@dataclass
class SetNode:
    """set_var: define `name` as `value` (JSON data), or as the text of `parts` (TextNode / VarNode) joined."""
    name: str
    parts: list[Any] | None
    value: Any = None


@dataclass
class IfNode:
    """Run `then` when the variable's value (a definition fixed at validation) passes the test, else
    `orelse`. It ends its node list: the rest of the stream is inside both arms."""
    name: str
    scope: str
    def_index: int
    test: str    # "eq" | "ne"
    value: str
    then: list[Any]
    orelse: list[Any]
    transforms: list[str] = field(default_factory=list)  # IF_TRANSFORMS keys, applied in order

    def holds(self, actual: Any) -> bool:
        for name in self.transforms:
            actual = IF_TRANSFORMS[name](actual)
        return (actual == self.value) == (self.test == "eq")


@dataclass
class Program:
    nodes: list[Any]
    name: str = "program"
    node_count: int = 0
    total_tokens: int = 0


