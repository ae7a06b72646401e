"""Expressions: what `s += ...` receives. Primitives build these; the interpreter and the tracer walk them.

Adding two expressions (or an expression and a str) makes a Concat, so `"Q: " + gen("a")` stays lazy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


class Expr:
    def __add__(self, other: Any) -> "Concat":
        return Concat([self, to_expr(other)])

    def __radd__(self, other: Any) -> "Concat":
        return Concat([to_expr(other), self])

    def var_names(self) -> list[str]:
        """Names of the variables this expression will define (so reads can wait on them)."""
        return []


def to_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Text(str(value))
    raise TypeError(f"cannot append a {type(value).__name__} to a program state")


@dataclass(eq=False)
class Text(Expr):
    value: str


@dataclass(eq=False)
class Concat(Expr):
    parts: list[Expr]

    def __post_init__(self):
        flat: list[Expr] = []
        for p in self.parts:  # keep the tree flat: long programs concatenate a lot
            flat.extend(p.parts if isinstance(p, Concat) else [p])
        self.parts = flat

    def var_names(self) -> list[str]:
        return [n for p in self.parts for n in p.var_names()]


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class Gen(Expr):
    name: str | None
    # Native SGLang `sampling_params` keys, only those the caller set.
    sampling: dict[str, Any] = field(default_factory=dict)
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None

    def var_names(self) -> list[str]:
        return [self.name] if self.name else []


@dataclass(eq=False)
class Select(Expr):
    name: str | None
    choices: list[str]
    temperature: float = 0.0
    choices_method: Any = None  # a lang_client.choices method object; None = token-length normalized

    def var_names(self) -> list[str]:
        return [self.name] if self.name else []


@dataclass(eq=False)
class Image(Expr):
    path: str


@dataclass(eq=False)
class VarRef(Expr):
    """A variable read while tracing: its value is only known at run time."""
    name: str
    scope: str

    def __str__(self):
        raise _data_dependent(f"str() of variable {self.name!r}")

    def __format__(self, spec):
        raise _data_dependent(f"formatting variable {self.name!r}")

    def __bool__(self):
        raise _data_dependent(f"truth value of variable {self.name!r}")

    def __eq__(self, other):
        raise _data_dependent(f"comparing variable {self.name!r}")

    __hash__ = object.__hash__


@dataclass(eq=False)
class ArgRef(Expr):
    """A program argument left unbound while tracing; the server fills it from the request's args."""
    name: str

    def __str__(self):
        raise _data_dependent(f"str() of unbound argument {self.name!r}")

    def __format__(self, spec):
        raise _data_dependent(f"formatting unbound argument {self.name!r}")

    def __bool__(self):
        raise _data_dependent(f"truth value of unbound argument {self.name!r}")


def _data_dependent(what: str) -> Exception:
    from lang_client.errors import TracingError
    return TracingError(f"{what} while tracing: remote programs cannot branch or format on values known only "
                        "at run time; use `+` to concatenate, or run the program locally")


def walk(expr: Expr, visit: Callable[[Expr], None]) -> None:
    """Visit the leaves of an expression in order."""
    if isinstance(expr, Concat):
        for p in expr.parts:
            walk(p, visit)
    else:
        visit(expr)
