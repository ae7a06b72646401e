"""Rewrite a wheel keeping only the files a predicate keeps, with a RECORD that lists exactly those files.

    python3 -m bench.wheel_trim libucx WHEEL     trim a libucx wheel in place (bench/fetch_wheels.sh)

`trim` is the generic part (bench/flashinfer_wheel.py uses it too); `libucx_keep` is the libucx predicate. The
libucx-cu13 wheel is 42 MB zipped, and most of it is what a Python ucxx user never loads (docs/performance.md,
"Running the suite"): static archives (`*.a`), the perftest tool's CUDA library and inputs (`*perftest*`) and the
command-line programs (`libucx/bin/`). Every shared library (each `.so`, `.so.0`, `.so.0.0.0` copy) stays: libucx's
loader dlopens `lib/libucs.so` etc. by unversioned name, and UCX loads its transport modules from `lib/ucx/`.
"""
from __future__ import annotations

import base64
import hashlib
import os
import sys
import zipfile
from pathlib import Path
from typing import Callable


def record_line(name: str, blob: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(blob).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(blob)}"


def trim(src: Path, dst: Path, keep: Callable[[str], bool]) -> tuple[list[str], list[zipfile.ZipInfo]]:
    """Write to dst the files of wheel src that keep(name) keeps, dist-info RECORD rewritten (directory entries go).

    Returns (kept names, ZipInfo of each dropped file). The RECORD itself is always written, never passed to keep.
    """
    kept: list[str] = []
    dropped: list[zipfile.ZipInfo] = []
    with zipfile.ZipFile(src) as zin:
        record_name = next(i.filename for i in zin.infolist() if i.filename.endswith(".dist-info/RECORD"))
        lines = []
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            for info in zin.infolist():
                name = info.filename
                if name == record_name or name.endswith("/"):
                    continue
                if not keep(name):
                    dropped.append(info)
                    continue
                blob = zin.read(name)
                zout.writestr(info, blob, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
                kept.append(name)
                lines.append(record_line(name, blob))
            # The source's RECORD entry (its timestamp): the same input trims to the same bytes.
            zout.writestr(zin.getinfo(record_name), "\n".join(lines + [f"{record_name},,"]) + "\n",
                          compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return kept, dropped


def libucx_keep(name: str) -> bool:
    """Everything but static archives, perftest (library, inputs, program) and the programs under libucx/bin/."""
    return not (name.endswith(".a") or "perftest" in name or name.startswith("libucx/bin/"))


def trim_in_place(wheel: Path, keep: Callable[[str], bool]) -> None:
    """Replace wheel by its trimmed copy (same name, so pip takes it as the downloaded one); print the sizes."""
    before = wheel.stat().st_size
    tmp = wheel.with_name(wheel.name + ".trim")
    try:
        kept, dropped = trim(wheel, tmp, keep)
        os.replace(tmp, wheel)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"{wheel.name}: dropped {len(dropped)} files ({sum(i.file_size for i in dropped) / 1e6:.0f} MB unpacked), "
          f"kept {len(kept)}; {before / 1e6:.1f} MB -> {wheel.stat().st_size / 1e6:.1f} MB zipped")


TRIMS = {"libucx": libucx_keep}


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in TRIMS:
        print(__doc__, file=sys.stderr)
        return 2
    trim_in_place(Path(args[1]), TRIMS[args[0]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
