"""Deletes what KVBM left in a disk directory or on a Redis/Valkey server.

    python scripts/clean_tiers.py disk DIR [--all] [--dry-run]
    python scripts/clean_tiers.py redis URL [--password-file FILE] [--dry-run]

disk: KVBM's files in DIR (and in DIR/dp<r>, data-parallel ranks' own
directories) are, per engine generation (namespace, TP size and rank; what
tiers/page_names.py names `kvbm_<16 hex>@<world>@<rank>`):
    kvbm_<16 hex>@<world>@<rank>@<hex>@uint8.pt        one page
    kvbm_<16 hex>@<world>@<rank>@<hex>@uint8.pt.tmp    a write cut short
    .kvbm-kvbm_<16 hex>@<world>@<rank>.lock            held by the engine using them
A running engine holds its generation's lock (tiers/disk/file_io.py); it counts,
evicts and adopts only its own generation's files. A generation nobody holds
(an engine before an upgrade of vLLM, PyTorch or a setting that changes the
keys: docs/upgrading.md) is never read again and never deleted by KVBM, and
is not charged to any disk_cache_size. By default this deletes exactly those
generations; the running engines' files stay. --all deletes every KVBM file
and refuses while any engine holds a lock. Other files are never touched.

redis: every key KVBM writes is a page named as above without the `.pt`
(`kvbm_<16 hex>@<world>@<rank>@<hex>@uint8`; with a page secret the parts
after `kvbm_` are keyed hashes, same shape). This deletes every key matching
`kvbm_*@uint8` (SCAN and UNLINK, never KEYS or FLUSHDB), all generations
alike: engines running on the server recompute what they miss. URL is a
remote_url (redis://, rediss://, valkey://, ...+cluster://); the password comes
from --password-file, else KVBM_REMOTE_PASSWORD_FILE.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import sys
from pathlib import Path

_OWNER = r"kvbm_[0-9a-f]{16}@\d+@\d+"
_PAGE = re.compile(rf"^({_OWNER})@[0-9a-f]+@uint8\.pt(\.tmp)?$")
_LOCK = re.compile(rf"^\.kvbm-({_OWNER})\.lock$")
REDIS_MATCH = "kvbm_*@uint8"


def _held(lock: Path) -> bool:
    """Whether a running engine holds ``lock`` (it keeps an exclusive flock)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken here at once
    return False


def _directories(root: Path) -> list[Path]:
    return [root, *sorted(p for p in root.glob("dp*") if p.is_dir() and p.name[2:].isdigit())]


def clean_disk(root: Path, everything: bool = False, dry_run: bool = False) -> tuple[int, int]:
    """Deletes the files of generations no running engine holds (all, with
    ``everything``) -> (files deleted, bytes freed)."""
    if not root.is_dir():
        raise SystemExit(f"clean_tiers: {root} is not a directory")
    plan = []
    for directory in _directories(root):
        live = {m.group(1) for p in directory.iterdir() if (m := _LOCK.match(p.name)) and _held(p)}
        if everything and live:
            raise SystemExit(
                f"clean_tiers: engines are running on {directory} "
                f"({', '.join(sorted(live))}); stop them before --all"
            )
        for path in directory.iterdir():
            match = _PAGE.match(path.name) or _LOCK.match(path.name)
            if match and match.group(1) not in live and path.is_file() and not path.is_symlink():
                plan.append(path)
    freed = 0
    for path in plan:
        size = path.stat().st_size
        if not dry_run:
            try:
                path.unlink()
            except FileNotFoundError:  # an engine evicted it meanwhile
                continue
        freed += size
    return len(plan), freed


def clean_redis(url: str, password_file: str | None, dry_run: bool = False) -> int:
    """Deletes every KVBM page on the server at ``url`` -> keys deleted."""
    from vllm_kvbm.config import load_config, parse_remote_url
    from vllm_kvbm.tiers.redis.connection import RedisLink

    environ = {"KVBM_REMOTE_URL": url}
    password_file = password_file or os.environ.get("KVBM_REMOTE_PASSWORD_FILE")
    if password_file:
        environ["KVBM_REMOTE_PASSWORD_FILE"] = password_file
    config = load_config({}, environ=environ)
    link = RedisLink(
        parse_remote_url("remote_url", config.remote_url),
        config.remote_password,
        timeout_s=30,
        tls_ca_file=config.remote_tls_ca_file,
    )

    def delete(client) -> int:
        deleted, batch = 0, []
        for key in client.scan_iter(match=REDIS_MATCH, count=1000):
            batch.append(key)
            if len(batch) == 500:
                deleted += len(batch) if dry_run else client.unlink(*batch)
                batch = []
        if batch:
            deleted += len(batch) if dry_run else client.unlink(*batch)
        return deleted

    try:
        deleted = link.call(delete, None, "cleanup")
    finally:
        link.close()
    if deleted is None:
        raise SystemExit(f"clean_tiers: {url} did not answer")
    return deleted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clean_tiers.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="tier", required=True)
    disk = sub.add_parser("disk", help="a disk_cache_dir")
    disk.add_argument("directory", type=Path)
    disk.add_argument(
        "--all", action="store_true", help="every KVBM file (no engine may be running on it)"
    )
    disk.add_argument("--dry-run", action="store_true")
    remote = sub.add_parser("redis", help="a Redis/Valkey remote_url")
    remote.add_argument("url")
    remote.add_argument("--password-file")
    remote.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    verb = "would delete" if args.dry_run else "deleted"
    if args.tier == "disk":
        files, freed = clean_disk(args.directory, args.all, args.dry_run)
        print(f"clean_tiers: {verb} {files} files ({freed / 2**30:.2f} GiB) in {args.directory}")
    else:
        keys = clean_redis(args.url, args.password_file, args.dry_run)
        print(f"clean_tiers: {verb} {keys} keys matching {REDIS_MATCH} on {args.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
