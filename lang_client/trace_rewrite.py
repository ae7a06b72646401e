"""While tracing, the program's own code keeps every string it builds from a generated value a TracedStr.

A generated value read while tracing is a str holding a marker (lang_client.expr). `+` and `%` on it give a
TracedStr, which refuses whatever would need the value (len(), int(), comparisons, slicing...). But
f-strings, `str.join`, `str.format` and `str()` are built by CPython itself and always give a plain str:
`len(f"{s['x']}!")` would silently measure the marker. So the tracer runs a recompiled copy of the program
function in which every f-string, every call's result and every `+` / `%` passes through `traced_str`,
which turns a plain str holding a marker into a TracedStr (anything else passes unchanged). Line numbers
and file name are the original's, so errors point at the user's line.

Only code written inside the program function (nested functions and lambdas included) is rewritten;
helpers defined elsewhere run as they are. When the source is not available (a REPL, `exec`), the function
runs unchanged, as before.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import types
import weakref
from typing import Any, Callable

from lang_client.expr import MARK_OPEN, TracedStr, _data_dependent

WRAP = "__lang_traced_str__"
_cache: "weakref.WeakKeyDictionary[Callable, Callable]" = weakref.WeakKeyDictionary()


REPR = "__lang_traced_repr__"


def traced_str(value: Any) -> Any:
    if type(value) is str and MARK_OPEN in value:
        return TracedStr(value)
    return value


def traced_repr(value: Any, conversion: str) -> str:
    """repr()/ascii() and f"{x!r}": the repr of a generated value is known only when it runs."""
    if isinstance(value, str) and MARK_OPEN in value:
        raise _data_dependent(f"{'repr' if conversion == 'r' else 'ascii'}() of a generated value")
    return repr(value) if conversion == "r" else ascii(value)


class _Wrap(ast.NodeTransformer):
    def _wrap(self, node: ast.expr) -> ast.expr:
        return ast.copy_location(ast.Call(func=ast.Name(WRAP, ast.Load()), args=[node], keywords=[]), node)

    @staticmethod
    def _repr(value: ast.expr, conversion: str) -> ast.expr:
        return ast.copy_location(ast.Call(func=ast.Name(REPR, ast.Load()),
                                          args=[value, ast.Constant(conversion)], keywords=[]), value)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.expr:
        for value in node.values:  # a format spec must stay a JoinedStr: only the formatted values change
            if isinstance(value, ast.FormattedValue):
                value.value = self.visit(value.value)
                if value.conversion in (ord("r"), ord("a")):  # f"{x!r}": checked like repr(x)
                    value.value, value.conversion = self._repr(value.value, chr(value.conversion)), -1
        return self._wrap(node)

    def visit_Call(self, node: ast.Call) -> ast.expr:
        self.generic_visit(node)
        if (isinstance(node.func, ast.Name) and node.func.id in ("repr", "ascii") and len(node.args) == 1
                and not node.keywords):
            return self._repr(node.args[0], node.func.id[0])
        return self._wrap(node)

    def visit_BinOp(self, node: ast.BinOp) -> ast.expr:
        self.generic_visit(node)
        return self._wrap(node) if isinstance(node.op, (ast.Add, ast.Mod)) else node


def instrument(func: Callable) -> Callable:
    """`func` recompiled as described above, or `func` itself when that is not possible."""
    try:
        return _cache[func]
    except (KeyError, TypeError):
        pass
    try:
        new = _rewrite(func)
    except (OSError, TypeError, SyntaxError, ValueError):
        new = None
    new = new or func
    try:
        _cache[func] = new
    except TypeError:
        pass
    return new


def _rewrite(func: Callable) -> Callable | None:
    code = getattr(func, "__code__", None)
    if code is None or func.__name__ == "<lambda>":
        return None
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef) or tree.body[0].name != func.__name__:
        return None
    fdef = tree.body[0]
    fdef.decorator_list = []
    fdef = _Wrap().visit(fdef)
    # An outer function whose parameters are the original's free variables (and the wrapper): compiled,
    # the inner function's free variables are bound to the original closure's cells below.
    params = [ast.arg(name) for name in (WRAP, REPR, *code.co_freevars)]
    outer = ast.FunctionDef(name="__lang_outer__", decorator_list=[], returns=None, type_comment=None,
                            args=ast.arguments(posonlyargs=[], args=params, vararg=None, kwonlyargs=[],
                                               kw_defaults=[], kwarg=None, defaults=[]),
                            body=[fdef, ast.Return(ast.Name(fdef.name, ast.Load()))])
    module = ast.Module(body=[outer], type_ignores=[])
    ast.copy_location(outer, fdef)
    ast.fix_missing_locations(module)
    ast.increment_lineno(module, code.co_firstlineno - 1)
    compiled = compile(module, code.co_filename, "exec", dont_inherit=True)
    outer_code = _const_code(compiled, "__lang_outer__")
    inner = _const_code(outer_code, func.__name__)
    if (inner is None or inner.co_argcount != code.co_argcount or inner.co_kwonlyargcount != code.co_kwonlyargcount
            or inner.co_varnames[:code.co_argcount] != code.co_varnames[:code.co_argcount]):
        return None  # the source on disk is not this function's (edited since it was imported)
    cells = dict(zip(code.co_freevars, func.__closure__ or ()))
    cells[WRAP], cells[REPR] = types.CellType(traced_str), types.CellType(traced_repr)
    if not all(name in cells for name in inner.co_freevars):
        return None
    new = types.FunctionType(inner, func.__globals__, func.__name__, func.__defaults__,
                             tuple(cells[name] for name in inner.co_freevars))
    new.__kwdefaults__ = func.__kwdefaults__
    return new


def _const_code(code: types.CodeType | None, name: str) -> types.CodeType | None:
    if code is None:
        return None
    return next((c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == name), None)
