"""A test that needs CUDA carries the `gpu` marker, so that `pytest -m gpu` on a GPU machine runs every one of
them: no test may skip itself on CUDA's absence (a skipif on `not torch.cuda.is_available()`, or an `if`
on it around pytest.skip) without the marker."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _cuda_absent(node: ast.AST) -> bool:
    """The expression holds `not <...>.cuda.is_available()`."""
    return any(isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not) and isinstance(n.operand, ast.Call)
               and ast.unparse(n.operand.func).endswith("cuda.is_available") for n in ast.walk(node))


def _is_mark(node: ast.AST, name: str) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return ast.unparse(target) in (f"pytest.mark.{name}", f"mark.{name}")


def _skips_without_cuda(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    if any(_is_mark(d, "skipif") and d.args and _cuda_absent(d.args[0]) for d in func.decorator_list):
        return True
    return any(isinstance(n, ast.If) and _cuda_absent(n.test)
               and any(isinstance(c, ast.Call) and ast.unparse(c.func) == "pytest.skip" for b in n.body for c in ast.walk(b))
               for n in ast.walk(func))


def unmarked_cuda_tests(source: str) -> list[str]:
    """Test functions of the module that skip without CUDA but are not marked gpu (nor is their module)."""
    tree = ast.parse(source)
    module_marks = [n.value for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]
    if any(_is_mark(m, "gpu") for v in module_marks for m in ([*v.elts] if isinstance(v, (ast.List, ast.Tuple)) else [v])):
        return []
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and n.name.startswith("test")]
    return [f.name for f in funcs
            if _skips_without_cuda(f) and not any(_is_mark(d, "gpu") for d in f.decorator_list)]


def test_every_test_that_needs_cuda_is_marked_gpu():
    files = sorted(TESTS.rglob("*.py"))  # test factories (kernels/_runner.py) too
    assert len(files) > 50  # the walk found the suite
    bad = [f"{p.relative_to(TESTS)}::{name}" for p in files for name in unmarked_cuda_tests(p.read_text())]
    assert not bad, "needs CUDA without @pytest.mark.gpu (the marker skips it without CUDA):\n" + "\n".join(bad)


def test_the_check_sees_each_way_of_skipping():
    source = '''
import pytest, torch

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decorated():
    pass

@pytest.mark.parametrize("x", [1])
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="sm90")
def test_compound(x):
    pass

def test_in_the_body():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="sm90")
def test_marked():
    pass

def test_on_either_device():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        device = "cpu"
'''
    assert unmarked_cuda_tests(source) == ["test_decorated", "test_compound", "test_in_the_body"]
    assert unmarked_cuda_tests("import pytest\npytestmark = [pytest.mark.gpu]\n" + source) == []
