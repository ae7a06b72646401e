"""kernels/ is pure (tensors in, tensors out): no module under it imports the engine, the models, the
services or anything else of this project outside kernels/, but for the knob registry (shared/knobs.py, a leaf of
the standard library alone). The attention backends that read a ForwardBatch live in shared/models/attention/."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("shared", "services", "lang_client", "bench", "tests")
ALLOWED = ("shared.knobs",)


def _imported_modules(path: Path):
    """(line, module) of every import in the file, at any depth (function-local imports included)."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative imports stay inside kernels/
                continue
            yield node.lineno, node.module or ""


def _violations(files) -> list[str]:
    return [f"{f.relative_to(f.parents[1])}:{line}: {mod}" for f in files for line, mod in _imported_modules(f)
            if mod.split(".")[0] in FORBIDDEN and mod not in ALLOWED]


def test_kernels_import_nothing_from_the_rest_of_the_project():
    files = sorted((ROOT / "kernels").rglob("*.py"))
    assert len(files) >= 10  # the walk found the package
    bad = _violations(files)
    assert not bad, "kernels/ must stay pure (tensors in, tensors out):\n" + "\n".join(bad)


def test_only_the_knob_registry_is_allowed_and_it_is_a_leaf(tmp_path):
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    for i, line in enumerate(["from shared.knobs import knob", "import shared.knobs", "from shared import knobs",
                              "from shared.engine import config"]):
        (pkg / f"k{i}.py").write_text(line + "\n")
    assert [v.split(": ")[1] for v in _violations(sorted(pkg.glob("*.py")))] == ["shared", "shared.engine"]
    # The registry itself imports nothing of the project, so kernels/ reaches nothing else through it.
    assert not [mod for _, mod in _imported_modules(ROOT / "shared" / "knobs.py")
                if mod.split(".")[0] in FORBIDDEN + ("kernels",)]


def test_the_check_sees_function_local_imports(tmp_path):
    f = tmp_path / "k.py"
    f.write_text("import torch\n\ndef f():\n    from shared.models.forward_batch import ForwardBatch\n")
    assert (4, "shared.models.forward_batch") in list(_imported_modules(f))
