"""What scripts/gpu_check.sh --bundle --slim needs done in Python (standard library only).

``strip`` rewrites a NIXL wheel keeping what benchmarks/gpu_check.py loads:
the Python package, the UCX, POSIX, GDS and GDS_MT plugins, UCX's CUDA,
shared-memory and InfiniBand/RDMA transports (the ones a production engine
on a machine with an RDMA NIC uses; ``--drop-ib`` leaves them out), and every
library those need (the closure of their ELF DT_NEEDED entries inside the
wheel). NIXL's expert-parallel kernels, cloud-storage plugins, UCX's perftest
modules, headers and scripts are dropped.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import posixpath
import struct
import sys
import zipfile
from pathlib import Path

KEEP_PLUGINS = ("UCX", "POSIX", "GDS", "GDS_MT")
# UCX loads its transports from <libs>/ucx/ by name (dlopen, not DT_NEEDED)
KEEP_UCX_MODULES = ("libuct_cma", "libuct_cuda", "libucm_cuda")
IB_UCX_MODULES = ("libuct_ib", "libuct_rdmacm", "libucs_ib")  # prefixes: ib, ib_mlx5, ...
_DT_NEEDED = 1


def elf_needed(data: bytes) -> list[str]:
    """DT_NEEDED names of a 64-bit little-endian ELF file ([] for anything else)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    names = []
    for _name, stype, _flags, _addr, off, size, link, _info, _align, entsize in sections:
        if stype != 6:  # SHT_DYNAMIC
            continue
        strtab_off = sections[link][4]
        for pos in range(off, off + size, entsize or 16):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == 0:
                break
            if tag == _DT_NEEDED:
                end = data.index(b"\0", strtab_off + val)
                names.append(data[strtab_off + val : end].decode())
    return names


def _roots(names: list[str], package: str, ib: bool = True) -> set[str]:
    """The files gpu_check loads directly (by import or by NIXL's dlopen)."""
    modules = KEEP_UCX_MODULES + (IB_UCX_MODULES if ib else ())
    keep = set()
    for name in names:
        top, base = name.split("/")[0], posixpath.basename(name)
        if top == package or top.endswith(".dist-info"):
            keep.add(name)
        elif top == f".{package}.mesonpy.libs" and "/plugins/" in name:
            if any(base == f"libplugin_{p}.so" for p in KEEP_PLUGINS):
                keep.add(name)
        elif (
            top == f"{package}.libs"
            and "/ucx/" in name
            and ".so" in base
            and base.split(".")[0].startswith(modules)
        ):
            keep.add(name)
    return keep


def keep_set(zf: zipfile.ZipFile, ib: bool = True) -> set[str]:
    """The wheel's files gpu_check needs: the roots and their libraries' closure."""
    names = [n for n in zf.namelist() if not n.endswith("/")]
    package = next(n.split("/")[0] for n in names if n.endswith("/_api.py"))
    by_base: dict[str, list[str]] = {}
    for n in names:
        if ".libs/" in n and "/plugins/" not in n and "/nixl/" not in n:
            by_base.setdefault(posixpath.basename(n), []).append(n)
    keep, todo = set(), sorted(_roots(names, package, ib))
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        if ".so" in posixpath.basename(name):
            for lib in elf_needed(zf.read(name)):
                todo += by_base.get(lib, [])
    return keep


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def strip_wheel(src: Path, dst: Path, ib: bool = True) -> tuple[int, int]:
    """Writes ``dst``: ``src`` with only keep_set's files (RECORD rewritten).
    -> (files kept, files dropped)."""
    with zipfile.ZipFile(src) as zf:
        keep = keep_set(zf, ib)
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        dropped = sum(1 for n in zf.namelist() if not n.endswith("/") and n not in keep)
        tmp = dst.with_suffix(".tmp")
        lines = []
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
            for info in zf.infolist():
                if info.filename not in keep or info.filename == record:
                    continue
                data = zf.read(info)
                out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
                lines.append(_record_line(info.filename, data))
            lines.append(f"{record},,")
            out.writestr(record, "\n".join(lines) + "\n")
    os.replace(tmp, dst)
    return len(keep), dropped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("strip", help="strip a NIXL wheel to what gpu_check loads")
    s.add_argument("src", type=Path)
    s.add_argument("dst", type=Path)
    s.add_argument(
        "--drop-ib", action="store_true", help="leave out UCX's InfiniBand/RDMA transports too"
    )
    args = p.parse_args(argv)
    kept, dropped = strip_wheel(args.src, args.dst, ib=not args.drop_ib)
    mib = (args.src.stat().st_size / 2**20, args.dst.stat().st_size / 2**20)
    print(
        f"{args.dst.name}: kept {kept} files, dropped {dropped}; "
        f"{mib[0]:.1f} MiB -> {mib[1]:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
