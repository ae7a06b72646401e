"""A program as the request carries it (lang_client's IR, version 1: msgspec Structs, one per op, closed to
unknown fields), the server's form of it after validation, and its limits.

services/gateway/programs/validate.py turns the first into the second; execute.py walks the second.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

IR_VERSION = 1
# Used when a role node carries no rendered text (the client normally sends its template's markers).
CHATML_ROLES = {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ("system", "user", "assistant")}
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
SCOPE_RE = re.compile(r"^(|f\d+\.\d+)$")
# What an if may apply to the value before comparing (the tracer's `s["x"].strip().lower() == "yes"`).
IF_TRANSFORMS = {"strip": str.strip, "lstrip": str.lstrip, "rstrip": str.rstrip, "lower": str.lower,
                 "upper": str.upper, "casefold": str.casefold}


# ---- the request's IR ----
class _Op(Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True):
    pass


class TextOp(_Op, tag="text"):
    text: str


class ArgOp(_Op, tag="arg"):
    name: str  # bound to the request's args: becomes text


class RoleBeginOp(_Op, tag="role_begin"):
    role: Literal["system", "user", "assistant"]
    text: str | None = None  # the template's marker (default: ChatML's)


class RoleEndOp(_Op, tag="role_end"):
    role: Literal["system", "user", "assistant"]
    text: str | None = None


class GenOp(_Op, tag="gen"):
    name: str | None = None
    sampling_params: dict[str, Any] = {}
    return_logprob: bool | None = None
    logprob_start_len: Annotated[int, Meta(ge=-1, le=1_000_000)] | None = None
    top_logprobs_num: Annotated[int, Meta(ge=-1, le=1_000_000)] | None = None


class SelectOp(_Op, tag="select"):
    choices: list[str]
    name: str | None = None
    temperature: Annotated[float, Meta(ge=0)] = 0.0
    method: Literal["token_length_normalized", "greedy_token_selection"] = "token_length_normalized"


class ForkOp(_Op, tag="fork"):
    id: Annotated[int, Meta(ge=0)]
    n: int
    branches: list[list[Op]]


class JoinOp(_Op, tag="join"):
    fork: int
    mode: Literal["gather_variable", "concate_and_append"] = "gather_variable"


class VarOp(_Op, tag="var"):
    name: str
    scope: str = ""


class SetOp(_Op, tag="set"):
    """Exactly one of `value` (JSON data) and `parts` (text, var and arg nodes joined)."""
    name: str
    value: Any = UNSET
    parts: list[Op] | UnsetType = UNSET


class Cond(Struct, kw_only=True, forbid_unknown_fields=True):
    var: str
    scope: str = ""
    test: Literal["eq", "ne"]
    value: str
    transforms: Annotated[list[Literal["strip", "lstrip", "rstrip", "lower", "upper", "casefold"]],
                          Meta(max_length=8)] = []


class IfOp(_Op, tag="if"):
    cond: Cond
    then: list[Op]
    orelse: list[Op] = msgspec.field(name="else")


Op = Union[TextOp, ArgOp, RoleBeginOp, RoleEndOp, GenOp, SelectOp, ForkOp, JoinOp, VarOp, SetOp, IfOp]


class ProgramIR(Struct, kw_only=True, forbid_unknown_fields=True):
    version: int = 1
    name: str = "program"
    args: Any = None  # the tracer's declared argument names (the request's args bind them)
    nodes: list[Op]


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


