"""The gateway's folders are its layers, each importing only those below it (imports at any depth, typing-only ones
included), so the request path reads top down: __main__ -> app (route table) -> api (routes, SSE, keys) -> state
-> routing / programs -> http (body, errors, metrics) -> the leaves (caps, the tokenization pool, gateway
processes)."""
from __future__ import annotations

from pathlib import Path

from tests.kernels.test_layering import _imported_modules

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "services" / "gateway"
# Lowest first; a module may import its own layer and those before it.
LAYERS = (("limits", "cpu_work", "pool"), ("http",), ("routing", "programs"), ("state",), ("api",),
          ("openapi", "cli"), ("app",), ("__main__",))


def _layer(module: str) -> int | None:
    """The layer of services.gateway.<part>..., None for anything else."""
    parts = module.split(".")
    if parts[:2] != ["services", "gateway"] or len(parts) < 3:
        return None
    return next(i for i, names in enumerate(LAYERS) if parts[2] in names)


def _upward_imports(files, root: Path = ROOT) -> list[str]:
    out = []
    for f in files:
        rel = f.relative_to(root).with_suffix("")
        own = _layer(".".join(rel.parts if rel.name != "__init__" else rel.parts[:-1]))
        for line, mod in _imported_modules(f):
            theirs = _layer(mod)
            if own is not None and theirs is not None and theirs > own:
                out.append(f"{f.relative_to(root)}:{line}: {mod} (layer {LAYERS[theirs]} above {LAYERS[own]})")
    return out


def test_every_gateway_module_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in GATEWAY.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert tops == {name for names in LAYERS for name in names}


def test_gateway_modules_import_only_their_layer_and_below():
    files = sorted(GATEWAY.rglob("*.py"))
    assert len(files) >= 40
    bad = _upward_imports(files)
    assert not bad, "an import runs up the gateway's layers:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import(tmp_path):
    pkg = tmp_path / "services" / "gateway" / "http"
    pkg.mkdir(parents=True)
    f = pkg / "x.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from services.gateway.state import S\n")
    assert _upward_imports([f], tmp_path) == ["services/gateway/http/x.py:3: services.gateway.state (layer ('state',) above "
                                    "('http',))"]
