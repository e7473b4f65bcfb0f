"""The shared page pool tier, as a worker reads and writes it (``PoolStore``).

Pages live in a pool file in memory (``pool_dir``, ``/dev/shm`` by default;
layout.py, pool_file.py) that outlives the engine: an engine restarted on the
same machine finds its pages at once, other engines of the same model on the
machine share them, and peers on other machines read them through NIXL
(tiers/peer/). The file comes from the kvbm-pool process when one answers on
``pool_socket`` (it keeps the file, and serves it to peers, while the engine
restarts); otherwise the worker keeps the file itself and, with
``pool_serve_port``, serves it to peers (one log line says which).

Used from TierIO's threads (a read thread and a write thread): a read is
memory copies and the page's check, a write an encode into the slot under
the pool's write lock (one page: other engines writing the same file wait
for at most that). Nothing here touches the disk; nothing raises.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import torch

from vllm_kvbm.tiers.base import TierStore
from vllm_kvbm.tiers.page_codec import PageCodec
from vllm_kvbm.tiers.page_format import HEADER_BYTES, valid_key, valid_page
from vllm_kvbm.tiers.pool import layout
from vllm_kvbm.tiers.pool.layout import EMPTY_KEY, ENTRY_BYTES, LAST_USE_OFF
from vllm_kvbm.tiers.pool.pool_file import PoolFile, PoolSpec, open_pool

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo

logger = logging.getLogger(__name__)

# Pages are copied into their slot this much per call: each chunk is
# checksummed (or sealed) right before it is copied, while in cache.
_CHUNK = 1 << 20


class PoolStore(TierStore):
    """``pool``: a PoolFile (held until close); ``codec``: this worker's
    PageCodec (namespace, rank, layout, page secret). ``server``: the peer
    server this worker runs for the file (None: kvbm-pool serves it, or no
    one does); ``directory``: what lists the file's pages in the peer
    directory (tiers/peer/directory.py; None: no directory, or not rank 0);
    both closed with the store."""

    name = "pool"
    write_inflight = 1  # writes into one file take turns under its lock anyway

    def __init__(
        self,
        pool: PoolFile,
        codec: PageCodec,
        server=None,
        lock_wait_s: float = 5.0,
        directory=None,
    ):
        if pool.geometry.stored_bytes != codec.stored_bytes:
            raise ValueError(
                f"pool file {pool.path} holds pages of "
                f"{pool.geometry.stored_bytes} bytes, this engine's are "
                f"{codec.stored_bytes}"
            )
        self.pool, self._codec, self.server = pool, codec, server
        self.directory = directory
        self.page_bytes = codec.page_bytes
        self._g = pool.geometry
        self._lock_wait_s = lock_wait_s
        # Under a page secret, the page keys of pages this store wrote or
        # read, by table key (a keyed hash does not give the key back), so a
        # page it evicts is reported (take_removed) under its key; bounded:
        # pages other engines evicted are never reported here.
        self._keys: OrderedDict[bytes, bytes] = OrderedDict()
        self._keys_max = 2 * pool.geometry.nslots
        self._keys_lock = threading.Lock()  # the read and the write thread; memory only
        self._removed: deque[bytes] = deque()
        self._closed = False
        self._writes_failing = False

    @classmethod
    def from_config(
        cls,
        config: "KVBMConfig",
        info: "EngineInfo",
        rank: int,
        secret: bytes | None,
        layout_fp: str,
    ) -> "PoolStore":
        from vllm_kvbm.tiers.pool.attach import open_engine_pool

        world = info.key_namespace.tp_size
        codec = PageCodec.for_worker(info, rank, secret, layout_fp)
        spec = PoolSpec.for_worker(
            config.pool_dir,
            info.tier_namespace,
            info.page_bytes,
            rank,
            world,
            layout_fp,
            config.pool_cache_bytes,
        )
        pool, server = open_engine_pool(config, spec, rank)
        directory = None
        try:
            from vllm_kvbm.tiers.peer.directory import pool_directory

            directory = pool_directory(config, pool, server, rank)
            return cls(pool, codec, server, directory=directory)
        except BaseException:
            if directory is not None:
                directory.close()
            if server is not None:
                server.close()
            pool.close()
            raise

    @classmethod
    def open(cls, spec: PoolSpec, codec: PageCodec) -> "PoolStore":
        """A store on its own pool file (tests, tools)."""
        return cls(open_pool(spec), codec)

    # -- writes --------------------------------------------------------------
    def put(self, key: bytes, page: torch.Tensor) -> bool:
        try:
            if self._closed or not valid_key(key) or not valid_page(page, self.page_bytes):
                return False
            key = bytes(key)
            tkey = layout.table_key(self._codec.names, key)
            if tkey == EMPTY_KEY:
                return False  # what marks an empty slot (no real key hashes to it)
            src = memoryview(page.contiguous().numpy())
            with self.pool.write_lock(self._lock_wait_s):
                ok = self._put(key, tkey, src)
            self._note_write(None)
            return ok
        except Exception as e:  # noqa: BLE001 - never raises
            self._note_write(e)
            return False

    def _put(self, key: bytes, tkey: bytes, src: memoryview) -> bool:
        g, view = self._g, self.pool.view
        first = g.set_of(tkey) * g.ways
        if layout.find(view, g, tkey) is not None:
            self._note_key(tkey, key)
            self._listed(tkey)  # written again: its directory entry renewed
            return True  # another engine (or this one) has written it
        slot, gen, old = self._victim(first)
        e = g.entry_off(slot)
        layout.write_u64(view, e, gen + 1)  # odd: being written
        self._encode(g.slot_off(slot), key, src)
        view[e + 8 : e + 8 + 32] = tkey
        layout.write_u64(view, e + LAST_USE_OFF, time.monotonic_ns())
        layout.write_u64(view, e, gen + 2)  # even: readable
        if old == EMPTY_KEY:
            self.pool.add_used(1)
        else:
            self._evicted(old)
        self._note_key(tkey, key)
        self._listed(tkey)
        return True

    def _listed(self, tkey: bytes) -> None:
        if self.directory is not None:
            self.directory.stored(tkey)  # queued: the directory's thread writes it

    def _victim(self, first: int) -> tuple[int, int, bytes]:
        """(slot, even generation to write from, key it held) in the set
        starting at ``first``: an empty slot, one a crashed writer left half
        written (odd), else the least recently used."""
        g, view = self._g, self.pool.view
        best = None
        for slot in range(first, first + g.ways):
            gen, tkey, last = layout.read_entry(view, g.entry_off(slot))
            if gen & 1:  # only a dead writer leaves one (writes hold the lock)
                return slot, gen + 1, tkey
            if tkey == EMPTY_KEY:
                return slot, gen, EMPTY_KEY
            if best is None or last < best[3]:
                best = (slot, gen, tkey, last)
        return best[0], best[1], best[2]

    def _encode(self, off: int, key: bytes, src: memoryview) -> None:
        """The page's stored bytes into the slot at ``off``: payload chunk by
        chunk (sealed straight into the slot under a secret), header last."""
        dst = self.pool.view[off : off + HEADER_BYTES + len(src)]
        signer = self._codec.signer(key)
        for pos in range(0, len(src), _CHUNK):
            chunk = src[pos : pos + _CHUNK]
            out = dst[HEADER_BYTES + pos : HEADER_BYTES + pos + len(chunk)]
            stored = signer.seal(chunk, out)
            if stored is chunk:
                out[:] = chunk
        dst[:HEADER_BYTES] = signer.header()

    def _note_key(self, tkey: bytes, key: bytes) -> None:
        if not self._codec.keyed:
            return  # the table key is the page key
        with self._keys_lock:
            self._keys[tkey] = key
            self._keys.move_to_end(tkey)
            while len(self._keys) > self._keys_max:
                self._keys.popitem(last=False)

    def _evicted(self, tkey: bytes) -> None:
        if self.directory is not None:
            self.directory.removed(tkey)
        if self._codec.keyed:
            with self._keys_lock:
                key = self._keys.pop(tkey, None)
        else:
            key = tkey
        if key is not None:
            self._removed.append(key)

    def _note_write(self, err) -> None:
        if err is not None and not self._writes_failing:
            self._writes_failing = True
            logger.warning(
                "pool tier: writes to %s failing (%s); puts return False until one succeeds",
                self.pool.path,
                err,
            )
        elif err is None and self._writes_failing:
            self._writes_failing = False
            logger.warning("pool tier: writes to %s succeed again", self.pool.path)

    # -- reads ---------------------------------------------------------------
    def get_into(self, key: bytes, out: torch.Tensor) -> str:
        try:
            if (
                self._closed
                or not valid_key(key)
                or not valid_page(out, self.page_bytes)
                or not out.is_contiguous()
            ):
                return "error"
            return self._read(bytes(key), out)
        except Exception as e:  # noqa: BLE001 - never raises
            logger.warning("pool tier: get failed: %s", e)
            return "error"

    def _read(self, key: bytes, out: torch.Tensor) -> str:
        g, view = self._g, self.pool.view
        tkey = layout.table_key(self._codec.names, key)
        hit = layout.find(view, g, tkey)
        if hit is None:
            return "miss"
        slot, gen = hit
        e, off = g.entry_off(slot), g.slot_off(slot)
        hdr = bytes(view[off : off + HEADER_BYTES])
        # Copied first, checked where it landed: what is checked is what is used.
        ctypes.memmove(out.data_ptr(), self.pool.addr + off + HEADER_BYTES, self.page_bytes)
        if layout.read_head(view, e) != (gen, tkey):
            return "miss"  # rewritten while read: torn, never used
        status = self._codec.verify(hdr, key, out)
        if status == "ok":
            layout.write_u64(view, e + LAST_USE_OFF, time.monotonic_ns())
            self._note_key(tkey, key)
        elif status in ("corrupt", "unauthenticated"):
            logger.warning("pool tier: %s page removed from %s", status, self.pool.path)
            self._drop(tkey, slot, gen)
        return status

    def contains(self, key: bytes) -> bool:
        try:
            return (
                not self._closed
                and valid_key(key)
                and layout.find(
                    self.pool.view, self._g, layout.table_key(self._codec.names, bytes(key))
                )
                is not None
            )
        except Exception:  # noqa: BLE001
            return False

    def remove(self, key: bytes) -> None:
        try:
            if self._closed or not valid_key(key):
                return
            tkey = layout.table_key(self._codec.names, bytes(key))
            hit = layout.find(self.pool.view, self._g, tkey)
            if hit is not None:
                self._drop(tkey, *hit)
        except Exception as e:  # noqa: BLE001
            logger.warning("pool tier: remove failed: %s", e)

    def _drop(self, tkey: bytes, slot: int, gen: int) -> None:
        """Empties ``slot`` if it still holds ``tkey`` at ``gen``."""
        view, e = self.pool.view, self._g.entry_off(slot)
        with self.pool.write_lock(self._lock_wait_s):
            if layout.read_head(view, e) != (gen, tkey):
                return  # rewritten meanwhile: not the page meant
            layout.write_u64(view, e, gen + 1)
            view[e + 8 : e + 8 + 32] = EMPTY_KEY
            layout.write_u64(view, e, gen + 2)
            self.pool.add_used(-1)
        if self.directory is not None:
            self.directory.removed(tkey)
        with self._keys_lock:
            self._keys.pop(tkey, None)

    # -- the rest ------------------------------------------------------------
    def usage(self) -> tuple[int, int]:
        # vLLM's worker thread, every step: two memory reads
        g = self._g
        return self.pool.used_slots * g.stride, g.nslots * g.stride

    def counts(self) -> dict[str, int]:
        """The peer directory's entries sent for this pool (rank 0's, where
        a directory is set): kvbm_peer_directory_entries_total; and, attached
        to kvbm-pool, whether it answers (``up``): kvbm_tier_up{tier="pool"}."""
        counts = {}
        if self.pool.watch is not None:
            counts["up"] = int(self.pool.watch.answering)
        if self.directory is not None:
            w = self.directory.writer
            counts.update(written=w.written, deleted=w.deleted, dropped=w.dropped, failed=w.failed)
        return counts

    def take_removed(self) -> list[bytes]:
        keys = []
        while self._removed:
            keys.append(self._removed.popleft())
        return keys

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.directory is not None:
            self.directory.close()  # its sweep reads the mapping: first
        if self.server is not None:
            self.server.close()
        self.pool.close()


def entry_bytes(pool: PoolFile, slot: int) -> bytes:
    """The raw entry of ``slot`` (tests)."""
    e = pool.geometry.entry_off(slot)
    return bytes(pool.view[e : e + ENTRY_BYTES])
