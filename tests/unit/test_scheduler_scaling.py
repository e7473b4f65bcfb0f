"""The scheduler side's work grows with what a step changes, not with prompt length.

Block keys are computed lazily (a lookup stops hashing at its first miss; a
store hashes only the new blocks), the host tier's slot accounting is O(1),
and the keys are the same as computed all at once. Speed itself is shown by
benchmarks/bench_scheduler.py, never asserted here; these tests check the
behaviour that makes it fast and that nothing else changed.
"""

from __future__ import annotations

import hashlib
import random
import struct
import subprocess
import sys
from pathlib import Path

from vllm.v1.request import RequestStatus

from helpers.scheduler_harness import BLOCK, block_ids, kvbm, make_request, make_scheduler, step
from vllm_kvbm.keys import KeyChain, vllm_key_mask
from vllm_kvbm.scheduler.slot_index import SlotIndex

ROOT = Path(__file__).resolve().parents[2]


def reference_keys(seed: bytes, block_size: int, salt: bytes, toks: list[int]) -> list[bytes]:
    """The key chain as specified: one SHA-256 per block over its int64 ids."""
    parent = hashlib.sha256(seed + salt).digest()
    keys = []
    for i in range(len(toks) // block_size):
        h = hashlib.sha256(parent)
        h.update(struct.pack(f"<{block_size}q", *toks[i * block_size : (i + 1) * block_size]))
        parent = h.digest()
        keys.append(parent)
    return keys


def reference_vllm_keys(seed: bytes, salt: bytes, req) -> list[bytes]:
    """Keys from vLLM's block hashes as specified: each XOR the request's mask."""
    mask = vllm_key_mask(seed, salt, "sha256")
    return [bytes(a ^ b for a, b in zip(h, mask)) for h in req.block_hashes]


class RecordingList(list):
    """A token list that records which index ranges were read."""

    def __init__(self, items):
        super().__init__(items)
        self.reads: list[tuple[int, int]] = []

    def __getitem__(self, item):
        if isinstance(item, slice):
            start, stop, _ = item.indices(len(self))
            self.reads.append((start, stop))
        else:
            self.reads.append((item, item + 1))
        return super().__getitem__(item)


def test_keychain_matches_the_reference_in_any_increments():
    rng = random.Random(1)
    seed = bytes(range(32))
    for block_size, salt in [(16, b""), (16, b"salt"), (7, b""), (128, b"x")]:
        toks = [rng.randrange(0, 2**40) for _ in range(block_size * 50 + 3)]
        want = reference_keys(seed, block_size, salt, toks)
        assert len(want) == 50
        chain = KeyChain(seed, block_size, salt)
        target = 0
        while target < 50:
            target = min(50, target + rng.choice([0, 1, 2, 5, 13]))
            chain.extend_to(toks, target)
            assert chain.keys == want[:target]
        chain.extend_to(toks, 10)  # never shrinks, never recomputes
        assert chain.keys == want
        # extend (all full blocks of what it is given) agrees too
        assert KeyChain(seed, block_size, salt).extend(toks) == want
        grown = KeyChain(seed, block_size, salt)
        for n in range(0, len(toks) + 1, 3 * block_size + 1):
            grown.extend(toks[:n])
        assert grown.extend(toks) == want


def test_keychain_reads_only_the_tokens_it_has_not_hashed():
    toks = RecordingList(range(16 * 100))
    chain = KeyChain(b"s" * 32, 16)
    chain.extend_to(toks, 3)
    chain.extend_to(toks, 3)
    chain.extend_to(toks, 10)
    assert toks.reads == [(0, 48), (48, 160)]
    assert chain.keys == reference_keys(b"s" * 32, 16, b"", list(toks)[:160])


def test_lookup_miss_hashes_no_further_than_the_step_computes():
    """A prompt nothing holds: the lookup hashes its first block only, and the
    first prefill chunk's stores hash that chunk; later blocks are hashed as
    their chunks are computed, not at the first lookup. (Our SHA-256 chain:
    keys from vLLM's hashes are an XOR each, derived for the whole lookup.)"""
    s = make_scheduler(max_batched=256, hash_algo="xxhash")
    k = kvbm(s)
    prompt = list(range(1000, 1000 + 4000))  # 250 blocks, chunks of 16 blocks
    req = make_request(prompt, max_tokens=1)
    s.add_request(req)
    _, meta, _ = step(s)
    chain = k._reqs[req.request_id].chain
    assert len(chain.keys) == 256 // BLOCK
    (store,) = meta.stores
    assert store.block_ids == block_ids(s, req.request_id)[:16]
    _, meta, _ = step(s)
    assert len(chain.keys) == 2 * 256 // BLOCK
    assert chain.keys == reference_keys(k._seed, BLOCK, b"", prompt)[:32]


def test_lookup_hit_stops_hashing_near_its_first_miss():
    """The stored prefix is found whole; hashing stops within twice the hit
    (and at least the hit) instead of running over the whole prompt (our
    SHA-256 chain)."""
    s = make_scheduler(max_batched=4096, num_blocks=2000, host_blocks=400, hash_algo="xxhash")
    k = kvbm(s)
    shared = list(range(5000, 5000 + 20 * BLOCK))
    first = make_request(shared + [1] * 8, max_tokens=1)
    s.add_request(first)
    while first.request_id in s.requests:
        step(s, complete=True)
    assert s.reset_prefix_cache()
    prompt = shared + list(range(90_000, 90_000 + 200 * BLOCK))
    req = make_request(prompt, max_tokens=1)
    s.add_request(req)
    matched, is_async = k.get_num_new_matched_tokens(req, 0)
    assert (matched, is_async) == (20 * BLOCK, True)
    chain = k._reqs[req.request_id].chain
    assert 21 <= len(chain.keys) <= 41
    assert chain.keys == reference_keys(k._seed, BLOCK, b"", prompt)[: len(chain.keys)]
    # vLLM's own step gets the same answer and loads the 20 blocks.
    _, meta, _ = step(s)
    (load,) = meta.loads
    assert len(load.slots) == 20 and not load.fetch
    assert s.requests[req.request_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_keys_from_vllms_hashes_are_derived_for_the_whole_lookup_in_one_call():
    """An XOR per key: one numpy call over the lookup's range beats doubling
    calls as the hit grows."""
    s = make_scheduler()
    k = kvbm(s)
    prompt = list(range(3000, 3000 + 100 * BLOCK + 5))
    req = make_request(prompt, max_tokens=1)
    matched, _ = k.get_num_new_matched_tokens(req, 0)
    chain = k._reqs[req.request_id].chain
    assert matched == 0 and chain.cheap
    assert chain.keys == reference_vllm_keys(k._seed, b"", req)[:100]


def test_decode_steps_plan_no_store_work():
    """Once a prompt is stored, a decode step's store planning neither hashes
    nor allocates (its full blocks were all considered already)."""
    s = make_scheduler()
    k = kvbm(s)
    req = make_request(list(range(7, 7 + 3 * BLOCK + 5)), max_tokens=40)
    s.add_request(req)
    step(s, complete=True)
    state = k._reqs[req.request_id]
    assert state.store.cursor == 3 and len(state.chain.keys) == 3
    for _ in range(30):  # decode tokens fill more blocks: not offloaded by default
        _, meta, _ = step(s, complete=True)
        assert not meta.stores
    assert state.store.cursor == 3 and len(state.chain.keys) == 3


def brute_available(index: SlotIndex) -> int:
    return len(index._free) + sum(1 for e in index._entries.values() if e.ready and not e.pins)


def test_slot_index_available_count_follows_every_operation():
    """available() keeps a running count; it equals a full scan after any mix
    of allocate, commit, pin, unpin, drop, clear, hold and release."""
    rng = random.Random(7)
    idx = SlotIndex(24)
    keys = [i.to_bytes(32, "big") for i in range(60)]
    pinned: list[bytes] = []
    held: list[int] = []
    seen = set()
    for _ in range(5000):
        op = rng.choice(
            [
                "alloc",
                "alloc",
                "commit",
                "commit",
                "pin",
                "unpin",
                "drop",
                "clear",
                "hold",
                "release",
            ]
        )
        key = rng.choice(keys)
        if op == "alloc" and key not in idx:
            idx.allocate(key)
        elif op == "commit":
            idx.commit([key])
        elif op == "pin" and idx.is_ready(key):
            idx.pin([key])
            pinned.append(key)
        elif op == "unpin" and pinned:
            idx.unpin([pinned.pop(rng.randrange(len(pinned)))])
        elif op == "drop":
            idx.drop(key)
        elif op == "clear" and rng.random() < 0.05:
            idx.clear()
        elif op == "hold":
            slot = rng.randrange(24)
            idx.hold([slot])
            held.append(slot)
        elif op == "release" and held:
            idx.release([held.pop(rng.randrange(len(held)))])
        assert idx.available() == brute_available(idx), op
        seen.add(idx.available())
    assert len(seen) > 10  # the mix reached many different states
    assert idx.evictions > 0


def test_bench_scheduler_quick_prints_its_table():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_scheduler.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = (
        "| phase | steps | running | waiting | vLLM ms/step | connector ms/step "
        "| connector / vLLM | GC ms/step |"
    )
    assert header in lines
    rows = [line for line in lines if line.startswith(("| fill |", "| steady |"))]
    assert len(rows) == 2
    # (the first queue may be admitted within the fill: no drain row then)
    rows += [line for line in lines if line.startswith("| drain (first queue) |")]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert int(cells[1]) > 0 and float(cells[4]) > 0 and float(cells[5]) > 0
        assert cells[6].endswith("%")
    steady = next(line for line in lines if line.startswith("steady:"))
    # the quick run exercises stores, disk spills and loads from disk
    assert "blocks stored 0," not in steady and "loaded 0 " not in steady
    assert "disk " in steady.split("loaded ", 1)[1].split(")", 1)[0]
    assert any(line.startswith("overall: connector adds ") for line in lines)
