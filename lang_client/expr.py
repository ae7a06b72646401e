"""Expressions: what `s += ...` receives. Primitives build these; the interpreter and the tracer walk them.

Adding two expressions (or an expression and a str) makes a Concat, so `"Q: " + gen("a")` stays lazy.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from lang_client.wire import IF_TRANSFORMS


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


# ---- placeholders while tracing ----
# A variable read (or an unbound argument) while tracing is a str whose text is a marker: two private-use
# characters around a number. Python's own string work (+, str.join, f-strings, %, str()) then carries the
# marker along like any text, and the tracer turns each marker back into a `var` (or `arg`) node when the
# string is appended. Whatever would need the value itself (its length, slicing it, hashing it) is refused.
MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"
MARKER_RE = re.compile(MARK_OPEN + r"(\d+)" + MARK_CLOSE)


class TracedStr(str):
    """A str holding markers: `+`, `%` and join keep the result a TracedStr (so a comparison or len() of
    `s["x"] + "!"` is refused too). f-strings, str.join on a literal and str() give plain strs, which only
    carry the markers; the tracer's rewrite of the program's code (lang_client/trace_rewrite.py) turns
    those back into TracedStrs."""
    what = "a string built from generated values"

    def __repr__(self) -> str:
        return f"<{self.what}>"

    def __add__(self, other):
        if isinstance(other, str):
            return TracedStr(str.__add__(str(self), str(other)))
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, str):
            return TracedStr(str.__add__(str(other), str(self)))
        return NotImplemented

    def __mod__(self, args):
        return TracedStr(str.__mod__(str(self), args))

    def __rmod__(self, fmt):
        if isinstance(fmt, str):
            return TracedStr(str.__mod__(str(fmt), self))
        return NotImplemented

    def __format__(self, spec):
        if spec:
            raise _data_dependent(f"a format spec ({spec!r}) on {self.what}")
        return str(self)

    def join(self, iterable):  # a separator built from generated values only moves markers around
        return TracedStr(str.join(str(self), iterable))

    def __hash__(self):
        raise _data_dependent(f"hashing {self.what} (a set or dict lookup)")

    def __len__(self):
        raise _data_dependent(f"len() of {self.what}")

    def __iter__(self):
        raise _data_dependent(f"iterating over {self.what}")

    def __getitem__(self, key):
        raise _data_dependent(f"indexing or slicing {self.what}")

    def __contains__(self, item):
        raise _data_dependent(f"`in` on {self.what}")

    def __lt__(self, other):
        raise _data_dependent(f"ordering {self.what}")

    __le__ = __gt__ = __ge__ = __lt__

    def __eq__(self, other):
        raise _data_dependent(f"comparing {self.what}")

    def __ne__(self, other):
        raise _data_dependent(f"comparing {self.what}")

    def __bool__(self):
        raise _data_dependent(f"truth value of {self.what}")

    def __int__(self):
        raise _data_dependent(f"int() of {self.what}")

    def __float__(self):
        raise _data_dependent(f"float() of {self.what}")


class Placeholder(TracedStr):
    """Base of VarRef and ArgRef: a str standing for a value known only when the program runs."""
    what = "value"

    def __new__(cls, marker_id: int, **fields):
        obj = super().__new__(cls, f"{MARK_OPEN}{marker_id}{MARK_CLOSE}")
        obj.marker_id = marker_id
        obj.__dict__.update(fields)
        return obj


def _refuse_method(method: str):
    def refuse(self, *args, **kwargs):
        raise _data_dependent(f"{method}() on {self.what}")
    refuse.__name__ = method
    return refuse


# Every str method that would look at the value; the concatenating ones (__add__, __mod__, __format__,
# __str__, join) stay, since they only move the marker around.
for _m in ("capitalize", "casefold", "center", "count", "encode", "endswith", "expandtabs", "find", "format",
           "index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit", "isidentifier", "islower",
           "isnumeric", "isprintable", "isspace", "istitle", "isupper", "ljust", "lower", "lstrip",
           "partition", "removeprefix", "removesuffix", "replace", "rfind", "rindex", "rjust", "rpartition",
           "rsplit", "rstrip", "split", "splitlines", "startswith", "strip", "swapcase", "title", "translate",
           "upper", "zfill", "__mul__", "__rmul__"):
    setattr(TracedStr, _m, _refuse_method(_m))


class VarRef(Placeholder):
    """A variable read while tracing. `name`, `scope`; `choices` when a select defined it. Comparing it
    with a constant (==, !=, `in` a tuple, truth value) asks the tracer for a branch."""
    what = "a generated variable"

    def __repr__(self) -> str:
        return f"<variable {self.name!r}>"

    def _branch(self, test: str, other):
        return self.tracer_hook(self, test, other)

    def __eq__(self, other):
        return self._branch("eq", other)

    def __ne__(self, other):
        return self._branch("ne", other)

    def __bool__(self):
        return self._branch("ne", "")

    __hash__ = Placeholder.__hash__


# What a comparison may apply to a variable first: wire.IF_TRANSFORMS, which the server applies the same way.


def _transform(method: str):
    def apply(self, *args):
        if args:
            raise _data_dependent(f"{method}() with arguments on {self.what}")
        return self.derive(self, method)
    apply.__name__ = method
    return apply


for _m in IF_TRANSFORMS:
    setattr(VarRef, _m, _transform(_m))


class ArgRef(Placeholder):
    """A program argument left unbound while tracing; the server fills it from the request's args."""
    what = "an unbound argument"

    def __repr__(self) -> str:
        return f"<argument {self.name!r}>"


def _data_dependent(what: str) -> Exception:
    from lang_client.errors import TracingError
    return TracingError(f"{user_line()}: {what} while tracing: a remote program can only concatenate, join "
                        "and format generated values, or compare them with constants (==, !=, in a tuple); "
                        "run the program without remote=True to do more")


def user_line() -> str:
    """file:line of the program code running now (the first frame outside the DSL; examples count)."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module.startswith("lang_client.") and not module.startswith("lang_client.examples")):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def walk(expr: Expr, visit: Callable[[Expr], None]) -> None:
    """Visit the leaves of an expression in order."""
    if isinstance(expr, Concat):
        for p in expr.parts:
            walk(p, visit)
    else:
        visit(expr)
