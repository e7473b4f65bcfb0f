"""Identity of a model's or a LoRA adapter's files, from every byte of them.

Keys must change when any weight byte changes (a fine-tune, a merged adapter
or an RL update saved at the same path) and must not change between two
copies of the same files (replicas, restarts, another host), so a
fingerprint is a BLAKE3 hash of the names and full contents of a directory's
config, index and weight files.

Reading a 140 GB checkpoint takes minutes, so each large file's digest is
cached on disk (``$KVBM_CACHE_DIR/fingerprints/``, default
``~/.cache/vllm_kvbm/fingerprints/``) under what changes whenever the file
does: (realpath, size, mtime, ctime, inode, device). ctime moves on every
write and cannot be set back by a user, so a rewrite that restores the size
and mtime is still seen. Restarts, replicas on one host and the worker
processes (which start while the scheduler hashes) read the cache; a per-entry
file lock makes the second process wait for the first one's digest instead of
reading the weights again, for ``LOCK_TIMEOUT_S`` at most (the first one may
hang on a dead filesystem): then it hashes the file itself, uncached. The
cache is kept to ``MAX_ENTRIES`` entries: past that, entries whose file
changed or is gone go first (an RL loop that saves weights in place leaves
one per save), then the oldest written.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import tempfile
import time

import blake3

from vllm_kvbm import opened_files, weight_files

logger = logging.getLogger(__name__)

FORMAT = "kvbm-files-v2"
# Files whose bytes decide the KV a model or an adapter computes for given token ids.
CONFIG_FILES = weight_files.CONFIG_FILES + ("adapter_config.json",)
INDEX_SUFFIX = weight_files.INDEX_SUFFIX
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Smaller files are hashed at once: reading them costs less than a cache entry.
CACHE_MIN_BYTES = 1 << 20
# A file written this recently may be written again within the same
# timestamp tick (coarse kernel clocks, network file systems), leaving its
# stat unchanged: its digest is used but not cached.
RACY_NS = 2_000_000_000

# Digests by stat key, so the scheduler and a worker in one process (and
# every adapter request) hash or read the cache once.
_memo: dict[tuple, str] = {}
_MEMO_MAX = 4096
# Entries kept on disk (about 300 bytes each); pruned down to 3/4 of it.
MAX_ENTRIES = 4096
# A temporary entry file this old was left by a process that died writing it.
STALE_TMP_S = 3600
# Another process's digest is waited for this long at most.
LOCK_TIMEOUT_S = 10.0
_warned_uncached = False
_warned_locked = False


def cache_dir() -> str | None:
    """Where file digests are cached; None when there is no usable home."""
    root = os.environ.get("KVBM_CACHE_DIR")
    if not root:
        home = os.path.expanduser("~")
        if home.startswith("~"):
            return None
        root = os.path.join(home, ".cache", "vllm_kvbm")
    return os.path.join(root, "fingerprints")


def counts(name: str) -> bool:
    """Whether a file of this name is part of a model's identity."""
    return name in CONFIG_FILES or name.endswith(INDEX_SUFFIX) or name.endswith(WEIGHT_SUFFIXES)


def stat_key(real: str, st: os.stat_result) -> tuple:
    return (real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def hash_file(path: str) -> str:
    """BLAKE3 of a file's bytes: memory-mapped and hashed on every core."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(path).hexdigest()


def file_digest(path: str) -> str:
    """The digest of one file, from the cache when its stat is unchanged."""
    real = os.path.realpath(path)
    key = stat_key(real, os.stat(real))
    digest = _memo.get(key)
    if digest is not None:
        return digest
    if key[1] < CACHE_MIN_BYTES:
        return _hash_checked(real, key)[0]
    entry = _entry_path(key)
    digest = _read_entry(entry, key) if entry else None
    if digest is None and entry:
        try:
            with _locked(entry):
                # Another process may have hashed it while this one waited.
                digest = _read_entry(entry, key)
                if digest is None:
                    digest, cacheable = _hash_checked(real, key)
                    if cacheable:
                        _write_entry(entry, key, digest)
                        _prune(os.path.dirname(entry))
        except LockTimeout:  # the other process may be hung: still correct, uncached
            _warn_locked(real)
        except OSError as err:  # read-only or missing cache: still correct, uncached
            _warn_uncached(entry, err)
    if digest is None:
        digest, _ = _hash_checked(real, key)
    return digest


def _hash_checked(real: str, key: tuple) -> tuple[str, bool]:
    """Hash a file; the digest may be cached only if the file kept its stat
    while it was read and was not written just before."""
    digest = hash_file(real)
    after = stat_key(real, os.stat(real))
    newest = max(key[2], key[3])
    cacheable = after == key and time.time_ns() - newest > RACY_NS
    if cacheable:
        if len(_memo) >= _MEMO_MAX:
            _memo.clear()
        _memo[key] = digest
    return digest, cacheable


def _entry_path(key: tuple) -> str | None:
    directory = cache_dir()
    if directory is None:
        return None
    name = blake3.blake3(json.dumps(key).encode()).hexdigest()[:40]
    return os.path.join(directory, name + ".json")


def _read_entry(entry: str, key: tuple) -> str | None:
    """The cached digest, or None when absent, unreadable, corrupt or for
    another stat (the entry names its key in full)."""
    try:
        with open(entry, "rb") as f:
            data = json.loads(f.read())
        digest = data["digest"]
        if data["format"] != FORMAT or tuple(data["key"]) != key:
            return None
        if not (isinstance(digest, str) and len(digest) == 64):
            return None
        int(digest, 16)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if len(_memo) >= _MEMO_MAX:
        _memo.clear()
    _memo[key] = digest
    return digest


def _write_entry(entry: str, key: tuple, digest: str) -> None:
    """Write then rename: a reader sees a whole entry or none."""
    directory = os.path.dirname(entry)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "key": list(key), "digest": digest}, f)
        os.replace(tmp, entry)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _prune(directory: str) -> None:
    """Keeps the cache to MAX_ENTRIES entries: stale ones (their file's stat
    changed, or it is gone) go first, then the oldest written. A lock file
    goes with its entry; a process still holding it only hashes once more."""
    try:
        with os.scandir(directory) as found:
            names = [e.name for e in found]
    except OSError:
        return
    entries = [n for n in names if n.endswith(".json")]
    now = time.time()
    for name in names:
        if name.startswith(".tmp-"):
            _remove_if_older(os.path.join(directory, name), now - STALE_TMP_S)
    if len(entries) <= MAX_ENTRIES:
        return
    fresh = []
    for name in entries:
        path = os.path.join(directory, name)
        if _entry_is_stale(path):
            _remove_entry(path)
        else:
            fresh.append(path)
    keep = MAX_ENTRIES * 3 // 4
    if len(fresh) > keep:
        fresh.sort(key=_mtime)
        for path in fresh[: len(fresh) - keep]:
            _remove_entry(path)


def _entry_is_stale(entry: str) -> bool:
    try:
        with open(entry, "rb") as f:
            key = tuple(json.loads(f.read())["key"])
        return stat_key(key[0], os.stat(key[0])) != key
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return True  # gone, unreadable or not an entry


def _remove_entry(entry: str) -> None:
    for path in (entry, entry[: -len(".json")] + ".lock"):
        try:
            os.unlink(path)
        except OSError:
            pass


def _remove_if_older(path: str, before: float) -> None:
    try:
        if os.stat(path).st_mtime < before:
            os.unlink(path)
    except OSError:
        pass


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


class LockTimeout(Exception):
    """Another process held an entry's lock past ``LOCK_TIMEOUT_S``."""


class _locked:
    """An exclusive flock on ``entry + '.lock'``; released when the process
    dies, so a crashed hasher never blocks the next start, and waited for
    ``LOCK_TIMEOUT_S`` at most (``LockTimeout``), so a hung one does not
    block this one either."""

    def __init__(self, entry: str):
        self._path = entry[: -len(".json")] + ".lock"

    def __enter__(self):
        os.makedirs(os.path.dirname(self._path), exist_ok=True)
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _flock_within(self._fd, LOCK_TIMEOUT_S)
        except BaseException:
            os.close(self._fd)
            raise
        return self

    def __exit__(self, *exc):
        os.close(self._fd)  # closing releases the lock
        return False


def _flock_within(fd: int, timeout: float) -> None:
    """flock(LOCK_EX) that gives up after ``timeout`` seconds (flock itself
    has no timeout): tried without blocking, at growing intervals."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockTimeout() from None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.1)


def _warn_locked(real: str) -> None:
    global _warned_locked
    if not _warned_locked:
        _warned_locked = True
        logger.warning(
            "KVBM: another process held the digest cache lock of %s for over %g s "
            "(hashing it, or hung); hashed here instead, uncached",
            real,
            LOCK_TIMEOUT_S,
        )


def _warn_uncached(entry: str | None, err: OSError) -> None:
    global _warned_uncached
    if not _warned_uncached:
        _warned_uncached = True
        logger.warning(
            "KVBM: cannot cache weight fingerprints under %s (%s); weights are "
            "hashed in full at every start. Set KVBM_CACHE_DIR to a writable "
            "directory to cache them.",
            os.path.dirname(entry or "") or "~",
            err,
        )


def files_fingerprint(directory: str, names: list[str] | None = None) -> str:
    """A hash of the names and every byte of files of a directory (default:
    its config, index and weight files, not its subdirectories); the same
    for any copy of them."""
    if names is None:
        names = [n for n in os.listdir(directory) if counts(n)]
    h = blake3.blake3(FORMAT.encode())
    for name in sorted(names):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            h.update(json.dumps([name, file_digest(path)]).encode() + b"\n")
    return h.hexdigest()


def local_model_dir(model: str, revision: str, cache_dir: str | None = None) -> str | None:
    """The local directory of a model path or an already downloaded HF model
    (in ``cache_dir``, vLLM's --download-dir, else the default HF cache)."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model, revision=revision or None, cache_dir=cache_dir or None, local_files_only=True
        )
    except Exception:  # noqa: BLE001 - not in the local HF cache
        return None


def model_fingerprint(
    model: str,
    revision: str = "",
    *,
    download_dir: str | None = None,
    load_format: str = "auto",
    remote_code: bool = False,
) -> str | None:
    """The fingerprint of the files vLLM loads a model's weights from
    (weight_files.py): a model file's bytes, or a directory's weight files
    for ``load_format``, their index and config, and with ``remote_code`` its
    modelling code. None, with a warning, when no file proves which weights
    vLLM runs (a loader that reads other stores, no weight file found):
    never a config file alone."""
    if os.path.isfile(model):  # a single-file checkpoint (GGUF): wherever it lies
        h = blake3.blake3(FORMAT.encode())
        h.update(json.dumps(["model-file", file_digest(model)]).encode() + b"\n")
        return h.hexdigest()
    directory = local_model_dir(model, revision, download_dir)
    if directory is None:
        logger.warning(
            "KVBM: found no local files of model %s%s; nothing proves which "
            "weights this engine runs, so its pages are its own (shared with no "
            "other engine or restart)",
            model,
            f" in --download-dir {download_dir}" if download_dir else "",
        )
        return None
    directory = os.path.realpath(directory)
    names = weight_files.model_files(directory, load_format, remote_code)
    if names is None:
        fmt = weight_files.load_format_of(load_format, directory)
        why = (
            f"no {fmt!r} weight files are in {directory}"
            if fmt in weight_files.FORMAT_PATTERNS
            else f"vLLM's {fmt!r} loader reads weights from where KVBM cannot hash them"
        )
        logger.warning(
            "KVBM: %s; nothing proves which weights this engine runs, so its "
            "pages are its own (shared with no other engine or restart)",
            why,
        )
        return None
    # The files vLLM read in this process, as it picked them (opened_files.py):
    # what is hashed must be them, unchanged, before and after the hash.
    selection = opened_files.latest(model)
    why = None if selection is None else _not_as_read(selection, directory, names)
    fingerprint = files_fingerprint(directory, names) if why is None else None
    if selection is not None and why is None:
        why = opened_files.moved(selection)
    if why is not None:
        logger.warning(
            "KVBM: the weight files vLLM loaded are not the ones at %s now (%s: "
            "a link moved or a file written while the engine started); nothing "
            "proves which weights this engine runs, so its pages are its own "
            "(shared with no other engine or restart)",
            model,
            why,
        )
        return None
    return fingerprint


def _not_as_read(
    selection: "opened_files.Selection", directory: str, names: list[str]
) -> str | None:
    """Why hashing ``names`` in ``directory`` would not hash the files vLLM
    picked in ``selection``, or None."""
    if selection.folder_real != directory:
        return f"vLLM read {selection.folder_real}"
    for path, _, _ in selection.files:
        if (
            os.path.realpath(os.path.dirname(path)) != directory
            or os.path.basename(path) not in names
        ):
            return f"vLLM read {path}, which KVBM does not hash"
    return opened_files.moved(selection)


def adapter_fingerprint(path: str) -> str:
    """The fingerprint of a LoRA adapter's files, re-read when they change.

    Called for every new request with an adapter: it stats the adapter's
    files (tens of microseconds, docs/benchmarks.md) and rehashes only when
    a stat changed, so an adapter rewritten in place gets new keys from its
    next request on. "" when it has none readable (removed or unreadable:
    vLLM cannot load it either).
    """
    return _on_adapter_files(path, _adapter_from, "")


def adapter_stat(path: str) -> tuple | None:
    """The stat of the files ``adapter_fingerprint(path)`` reads (None: none
    readable): equal before and after a read of them only if no write
    happened in between (worker/lora_loads.py)."""
    return _on_adapter_files(path, _dir_stat, None)


def _on_adapter_files(path: str, read, missing):
    """``read(directory)`` of an adapter path: a directory, else an HF id's
    snapshot directory; ``missing`` when there is none or it cannot be read."""
    if not path:
        return missing
    try:
        try:
            return read(path)
        except (FileNotFoundError, NotADirectoryError):
            directory = _resolved_adapter_dir(path)  # an HF id, not a directory
            return read(directory) if directory else missing
    except OSError:
        return missing


def _adapter_from(directory: str) -> str:
    # No realpath: a link moved to other files changes their stat (inode,
    # device), and that alone keys the cache.
    stats = _dir_stat(directory)
    newest = max((max(s[2], s[3]) for s in stats), default=0)
    if time.time_ns() - newest <= RACY_NS:
        return files_fingerprint(directory)  # may change again unseen: not kept
    return _adapter_by_stat(directory, stats)


_resolved: dict[str, str] = {}


def _resolved_adapter_dir(path: str) -> str | None:
    """An HF id's snapshot directory (its files are content addressed).
    Only found ones are kept: vLLM downloads an adapter it does not have
    when it first loads it, after its first request arrived."""
    directory = _resolved.get(path)
    if directory is None:
        directory = local_model_dir(path, "")
        if directory is not None:
            if len(_resolved) >= 256:
                _resolved.clear()
            _resolved[path] = directory
    return directory


def _dir_stat(directory: str) -> tuple:
    with os.scandir(directory) as entries:
        return tuple(
            sorted(
                (e.name,) + stat_key("", e.stat())[1:]
                for e in entries
                if counts(e.name) and e.is_file()
            )
        )


@functools.lru_cache(maxsize=256)
def _adapter_by_stat(directory: str, stats: tuple) -> str:
    return files_fingerprint(directory)


def clear_memory_cache() -> None:
    """Forget in-process digests (as a restarted process would)."""
    _memo.clear()
    _adapter_by_stat.cache_clear()
    _resolved.clear()
