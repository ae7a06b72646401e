"""A program as the request carries it (lang_client's IR, version 1: msgspec Structs, one per op, closed to
unknown fields), the validated Program (those ops plus side tables), and its limits.

services/gateway/programs/validate.py turns the first into the second; execute.py walks the second.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

import msgspec
from lang_client.wire import IF_TRANSFORMS, IR_VERSION, apply_transforms
from msgspec import UNSET, Meta, Struct, UnsetType

# A variable's or argument's name; a scope: "" (the main stream) or "f<fork id>.<branch>".
Name = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_\-]*$", max_length=128)]
Scope = Annotated[str, Meta(pattern=r"^(|f\d+\.\d+)$")]
MAX_FORK_WIDTH = 64  # n of one fork
MAX_CHOICES = 256    # choices of one select


# ---- the request's IR ----
class _Op(Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True):
    pass


class TextOp(_Op, tag="text"):
    text: str


class ArgOp(_Op, tag="arg"):
    name: Name  # bound to the request's args: becomes text


class RoleBeginOp(_Op, tag="role_begin"):
    role: Literal["system", "user", "assistant"]
    text: str | None = None  # the template's marker (the client sends its own; default: ChatML's)


class RoleEndOp(_Op, tag="role_end"):
    role: Literal["system", "user", "assistant"]
    text: str | None = None


class GenOp(_Op, tag="gen"):
    name: Name | None = None
    sampling_params: dict[str, Any] = {}
    return_logprob: bool | None = None
    logprob_start_len: Annotated[int, Meta(ge=-1, le=1_000_000)] | None = None
    top_logprobs_num: Annotated[int, Meta(ge=-1, le=1_000_000)] | None = None


class SelectOp(_Op, tag="select"):
    choices: Annotated[list[str], Meta(min_length=1, max_length=MAX_CHOICES)]
    name: Name | None = None
    temperature: Annotated[float, Meta(ge=0, le=sys.float_info.max)] = 0.0  # finite
    method: Literal["token_length_normalized", "greedy_token_selection"] = "token_length_normalized"


class ForkOp(_Op, tag="fork"):
    id: Annotated[int, Meta(ge=0)]
    n: Annotated[int, Meta(ge=1, le=MAX_FORK_WIDTH)]
    branches: list[list[Op]]


class JoinOp(_Op, tag="join"):
    fork: int
    mode: Literal["gather_variable", "concate_and_append"] = "gather_variable"


class VarOp(_Op, tag="var"):
    name: Name
    scope: Scope = ""


class SetOp(_Op, tag="set"):
    """Exactly one of `value` (JSON data) and `parts` (text, var and arg nodes joined)."""
    name: Name
    value: Any = UNSET
    parts: list[Union[TextOp, VarOp, ArgOp]] | UnsetType = UNSET


class Cond(Struct, kw_only=True, forbid_unknown_fields=True):
    var: Name
    scope: Scope = ""
    test: Literal["eq", "ne"]
    value: str
    transforms: Annotated[list[Literal[IF_TRANSFORMS]], Meta(max_length=8)] = []  # applied before comparing


class IfOp(_Op, tag="if"):
    cond: Cond
    then: list[Op]
    orelse: list[Op] = msgspec.field(name="else")


Op = Union[TextOp, ArgOp, RoleBeginOp, RoleEndOp, GenOp, SelectOp, ForkOp, JoinOp, VarOp, SetOp, IfOp]


class ProgramIR(Struct, kw_only=True, forbid_unknown_fields=True):
    version: int = 1
    name: Annotated[str, Meta(max_length=128)] = "program"
    args: Any = None  # the tracer's declared argument names (the request's args bind them)
    nodes: list[Op]


class ProgramRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of POST /v1/programs: a traced lang_client program (IR version 1; validate.py checks what its types
    cannot say) and the arguments it binds."""
    program: ProgramIR
    args: dict[str, str | int | float] | None = None
    stream: bool = False


@dataclass(frozen=True)
class ProgramLimits:
    max_nodes: int = 4096              # every node, branches included
    max_total_tokens: int = 131072     # sum of max_new_tokens over all gens (default 128 each)
    max_depth: int = 8                 # fork nesting
    max_if_depth: int = 128            # if nesting (the tracer makes at most 64 branches on one path)
    max_text_chars: int = 1_000_000    # literal text, role markers, choices, grammars and bound args


# ---- the validated program ----
@dataclass
class Program:
    """The request's ops after validation: `arg` ops bound (text ops), role ops' text filled in, and side
    tables keyed by id(op): which definition each read (var op, if op) sees, and what a gather_variable
    join gathers ((names every branch defines, names only some paths define))."""
    nodes: list[Op]
    reads: dict[int, int] = field(default_factory=dict)
    joins: dict[int, tuple[list[str], list[str]]] = field(default_factory=dict)


def if_holds(cond: Cond, actual: Any) -> bool:
    return (apply_transforms(actual, cond.transforms) == cond.value) == (cond.test == "eq")
