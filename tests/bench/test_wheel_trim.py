"""bench.wheel_trim: a trimmed wheel holds exactly the kept files, its RECORD lists exactly those with their sha256
and size, and pip installs it (bench/fetch_wheels.sh replaces the libucx wheel by its trim; the GPU run installs it)."""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import sys
import zipfile

from bench.wheel_trim import libucx_keep, trim

DIST = "fakepkg-1.0.dist-info"
FILES = {
    "fakepkg/__init__.py": b"VALUE = 42\n",
    "fakepkg/lib/libfoo.so": b"\x7fELF shared" * 50,
    "fakepkg/lib/libfoo.so.0": b"\x7fELF shared" * 50,
    "fakepkg/lib/libfoo.a": b"!<arch>\n" + b"x" * 4000,
    "fakepkg/bin/tool": b"\x7fELF program",
    "fakepkg/share/notes.txt": b"kept\n",
    f"{DIST}/METADATA": b"Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.0\n",
    f"{DIST}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
DROPPED = {"fakepkg/lib/libfoo.a", "fakepkg/bin/tool"}


def _fake_wheel(path):
    record = [f"{n},sha256=stale,{len(b)}" for n, b in FILES.items()] + [f"{DIST}/RECORD,,"]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("fakepkg/", b"")  # a directory entry, as some wheels have
        for name, blob in FILES.items():
            z.writestr(name, blob)
        z.writestr(f"{DIST}/RECORD", "\n".join(record) + "\n")


def test_trim_keeps_what_the_predicate_keeps_with_a_correct_record_and_pip_installs_it(tmp_path):
    src, dst = tmp_path / "src" / "fakepkg-1.0-py3-none-any.whl", tmp_path / "fakepkg-1.0-py3-none-any.whl"
    src.parent.mkdir()
    _fake_wheel(src)
    kept, dropped = trim(src, dst, lambda n: not (n.endswith(".a") or n.startswith("fakepkg/bin/")))

    assert {i.filename for i in dropped} == DROPPED
    assert set(kept) == set(FILES) - DROPPED
    with zipfile.ZipFile(dst) as z:
        assert set(z.namelist()) == set(kept) | {f"{DIST}/RECORD"}
        rows = list(csv.reader(io.StringIO(z.read(f"{DIST}/RECORD").decode())))
        assert [r[0] for r in rows if r[0] != f"{DIST}/RECORD"] == kept
        assert [f"{DIST}/RECORD", "", ""] in rows
        for name, digest, size in (r for r in rows if r[0] != f"{DIST}/RECORD"):
            blob = z.read(name)
            assert blob == FILES[name]
            want = base64.urlsafe_b64encode(hashlib.sha256(blob).digest()).rstrip(b"=").decode()
            assert (digest, int(size)) == (f"sha256={want}", len(blob))

    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--target", str(target), str(dst)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (target / "fakepkg" / "lib" / "libfoo.so.0").read_bytes() == FILES["fakepkg/lib/libfoo.so.0"]
    assert not (target / "fakepkg" / "lib" / "libfoo.a").exists() and not (target / "fakepkg" / "bin").exists()


def test_libucx_trim_keeps_every_shared_library_and_the_loader():
    keep = ["libucx/load.py", "libucx/lib/libucp.so", "libucx/lib/libucp.so.0", "libucx/lib/libucp.so.0.0.0",
            "libucx/lib/libucs_signal.so", "libucx/lib/ucx/libuct_cma.so.0", "libucx/lib/ucx/libuct_cuda.so",
            "libucx/lib/ucx/libucm_cuda.so.0.0.0", "libucx/etc/ucx/ucx.conf", "libucx_cu13.libs/libcudart-96c42e41.so.13",
            "libucx_cu13-1.21.0.dist-info/METADATA"]
    drop = ["libucx/lib/libucp.a", "libucx/lib/ucx/libuct_cuda.a", "libucx/lib/ucx/libucx_perftest_cuda.so.0",
            "libucx/share/ucx/perftest/msg_pow2", "libucx/bin/ucx_info", "libucx/bin/io_demo"]
    assert [n for n in keep if not libucx_keep(n)] == []
    assert [n for n in drop if libucx_keep(n)] == []
