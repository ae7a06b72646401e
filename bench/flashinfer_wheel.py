"""Repack the flashinfer-python wheel down to what the attention, sampling and norm kernels build from.

    python3 -m bench.flashinfer_wheel SRC.whl OUT_DIR

The wheel is pure Python plus the C++/CUDA sources FlashInfer's JIT compiles on first use: 101 MB zipped,
most of it sources of modules an attention backend never builds (fused MoE, FP4 all-reduce, Mamba, KDA,
Blackwell-only kernels, trainers). What stays (docs/kernels.md, "FlashInfer"):

- Python: every module `import flashinfer` can reach, by a static walk of the import statements (function-level
  imports included) from the package root, plus all of flashinfer/jit/. Sources inside Python packages
  (trainers' and MoE backends' csrc trees) go.
- data/csrc: only the files the JIT generators of the kept kernels read, found by running those generators here
  on a CPU (sm90a targets: paged decode, FA2 and sm90 batch prefill paged/ragged, single decode, cascade
  merge, page append, sampling, norm, rope, activation, top-k; bf16/fp16/fp8 KV; head dims 64/128/256),
  plus what their #include lines reach.
- data/include (FlashInfer's headers), data/cutlass, data/cccl and data/spdlog whole: include paths of every
  JIT build, small zipped, and their headers select by macros a static scan cannot follow.

Needs torch and apache-tvm-ffi importable here (the generators import flashinfer); nothing is compiled.
"""
from __future__ import annotations

import ast
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from bench.wheel_trim import trim

PKG = "flashinfer"
DATA = f"{PKG}/data/"
# Include trees kept whole (see the docstring).
WHOLE = ("include/", "cutlass/", "cccl/", "spdlog/")
INCLUDE_DIRS = ("csrc", "include", "cutlass/include", "cutlass/tools/util/include", "spdlog/include", "cccl/cub",
                "cccl/libcudacxx/include", "cccl/thrust")
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.M)
_IMPORT = re.compile(r"^\s*(?:from\s+(\.*[\w.]*)\s+import\s+([\w, ()]+)|import\s+([\w.]+))", re.M)

# Run under the unpacked wheel: builds the JIT specs of the kept kernels (writing only generated sources) and
# prints the files they read. Arguments: the JSON output path.
_GENERATORS = r'''
import builtins, json, os, pathlib, sys
opened = set()
_open, _read = builtins.open, pathlib.Path.read_text
def rec(f):
    try: opened.add(str(pathlib.Path(f).resolve()))
    except Exception: pass
def open_(f, *a, **k):
    rec(f); return _open(f, *a, **k)
def read_text(self, *a, **k):
    rec(self); return _read(self, *a, **k)
builtins.open, pathlib.Path.read_text = open_, read_text
import torch
import flashinfer.jit.env as env
from flashinfer.jit.attention import modules as M
from flashinfer.jit import activation, cascade, norm, page, rope, sampling, topk
specs = []
for hd in (64, 128, 256):
    for q, kv in ((torch.bfloat16,) * 2, (torch.float16,) * 2, (torch.bfloat16, torch.float8_e4m3fn)):
        specs.append(M.gen_batch_decode_module(q, kv, q, torch.int32, hd, hd, 0, False, False))
        specs.append(M.gen_single_decode_module(q, kv, q, hd, hd, 0, False, False))
        specs.append(M.gen_batch_prefill_module("fa3", q, kv, q, torch.int32, hd, hd, 0, False, False, False))
        for gen in (M.gen_batch_prefill_module, M._gen_batch_prefill_primary_module,
                    M._gen_batch_prefill_independent_paged_module):
            specs.append(gen("fa2", q, kv, q, torch.int32, hd, hd, 0, False, False, False))
specs += [cascade.gen_cascade_module(), page.gen_page_module(), sampling.gen_sampling_module(),
          norm.gen_norm_module(), rope.gen_rope_module(), activation.gen_act_and_mul_module("silu"),
          topk.gen_topk_module()]
sources = sorted({str(pathlib.Path(p).resolve()) for s in specs for p in s.sources})
json.dump({"sources": sources, "opened": sorted(opened), "gen": str(env.FLASHINFER_GEN_SRC_DIR.resolve())},
          open(sys.argv[1], "w"))
print(len(specs), "JIT specs,", len(sources), "sources", file=sys.stderr)
'''


def _module_path(root: Path, mod: str) -> Path | None:
    p = root / mod.replace(".", "/")
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    return p.with_suffix(".py") if p.with_suffix(".py").is_file() else None


def _imports(root: Path, mod: str, path: Path) -> list[str]:
    """Modules of the package that `mod`'s import statements name (anywhere in the file)."""
    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    found: list[tuple[int, str, list[str]]] = []  # (relative level, module, names)
    try:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                found.append((node.level, node.module or "", [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                found += [(0, a.name, []) for a in node.names]
    except SyntaxError:  # newer syntax than this interpreter's: the import lines by pattern
        for rel, names, plain in _IMPORT.findall(path.read_text()):
            if plain:
                found.append((0, plain, []))
            else:
                level = len(rel) - len(rel.lstrip("."))
                found.append((level, rel.lstrip("."), [n.strip() for n in names.strip("()").split(",") if n.strip()]))
    out = []
    for level, name, names in found:
        if level:
            name = ".".join(base[:len(base) - level + 1] + ([name] if name else []))
        out += [name] + [f"{name}.{n}" for n in names]
    return [m for m in out if m == PKG or m.startswith(PKG + ".")]


def python_keep(root: Path) -> set[str]:
    """Paths (relative to root) of the package's modules reachable from `import flashinfer`, plus flashinfer/jit."""
    seen: set[str] = set()
    todo = [PKG]
    while todo:
        mod = todo.pop()
        path = _module_path(root, mod)
        if mod in seen or path is None:
            continue
        seen.add(mod)
        parts = mod.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += _imports(root, mod, path)
    keep = {str(_module_path(root, m).relative_to(root)) for m in seen}
    keep |= {str(p.relative_to(root)) for p in (root / PKG / "jit").rglob("*.py")}
    return keep


def csrc_keep(root: Path) -> set[str]:
    """Paths (relative to root) under data/csrc the kept kernels' JIT builds read, #include closure included."""
    data = root / DATA
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "specs.json"
        env = dict(os.environ, PYTHONPATH=str(root), FLASHINFER_WORKSPACE_BASE=tmp, FLASHINFER_CUDA_ARCH_LIST="9.0a")
        subprocess.run([sys.executable, "-c", _GENERATORS, str(out)], env=env, check=True)
        found = json.loads(out.read_text())
        dirs = [Path(found["gen"])] + [data / d for d in INCLUDE_DIRS]
        todo = [Path(p) for p in found["sources"] + found["opened"] if p.startswith(str(data)) or
                p.startswith(found["gen"])]
        seen: set[Path] = set()
        while todo:
            f = todo.pop()
            if f in seen or not f.is_file():
                continue
            seen.add(f)
            for name in _INCLUDE.findall(f.read_text(errors="replace")):
                hit = next((b / name for b in [f.parent] + dirs if (b / name).is_file()), None)
                if hit is not None:
                    todo.append(hit.resolve())
    csrc = str(data / "csrc") + "/"
    keep = {str(p.relative_to(root)) for p in seen if str(p).startswith(csrc)}
    # Every top-level template and config fragment (a few KB): generators for variants not enumerated above.
    keep |= {str(p.relative_to(root)) for p in (data / "csrc").glob("*") if p.suffix in (".jinja", ".inc")}
    return keep


def repack(src: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / src.name
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(src) as zin:
        root = Path(tmp)
        zin.extractall(root)
        keep_py, keep_csrc = python_keep(root), csrc_keep(root)

    def kept(name: str) -> bool:
        if not name.startswith(PKG + "/"):
            return True  # dist-info, the small top-level helpers
        if name.startswith(DATA):
            rest = name[len(DATA):]
            return rest.startswith(WHOLE) or name in keep_csrc or "/" not in rest
        return name in keep_py or name.endswith("py.typed")

    names, dropped_infos = trim(src, dst, kept)
    dropped: collections.Counter = collections.Counter()
    dropped_files: collections.Counter = collections.Counter()
    for info in dropped_infos:
        parts = info.filename.split("/")
        group = "/".join(parts[:3] if parts[1] == "data" else parts[:2])
        dropped[group] += info.file_size
        dropped_files[group] += 1
    print(f"dropped (unpacked sizes), {sum(dropped_files.values())} files, {sum(dropped.values()) / 1e6:.0f} MB:")
    for group, size in dropped.most_common():
        if size >= 1 << 20:
            print(f"  {size / 1e6:8.1f} MB  {dropped_files[group]:5d} files  {group}")
    small = [g for g, s in dropped.items() if s < 1 << 20]
    print(f"  {sum(dropped[g] for g in small) / 1e6:8.1f} MB  {sum(dropped_files[g] for g in small):5d} files  "
          f"{len(small)} smaller groups")
    print(f"kept {len(names)} files; {src.stat().st_size / 1e6:.0f} MB -> {dst.stat().st_size / 1e6:.1f} MB zipped: {dst}")
    return dst


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    repack(Path(args[0]), Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
