"""No wait on a fingerprint where vLLM's threads would wait for it.

vLLM's scheduler thread never hashes a LoRA adapter, stats its files or
takes a digest's file lock: that runs on the connector's adapter thread
(scheduler/adapter_fingerprints.py), and a request whose adapter it has not
fingerprinted yet is a miss. The digest cache's file lock, which another
process may hold (hashing, or hung on a dead filesystem), is waited for
until ``fingerprints.LOCK_TIMEOUT_S`` at most: then the file is hashed
here, uncached.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

from test_fingerprints import own_cache  # noqa: F401 - autouse: a digest cache of its own
from vllm_kvbm import fingerprints as fp

WEIGHT_BYTES = 2 << 20  # over CACHE_MIN_BYTES: its digest is cached, under a lock


def save_adapter(path, step: int) -> str:
    """An adapter as an RL loop saves it after step ``step``: new weights
    (and a new size, so even a coarse clock sees the write)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write('{"r": 8}')
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(bytes([step % 251]) * (WEIGHT_BYTES + step))
    return str(path)


class FlockHolder:
    """Another process holding the flock of a digest cache entry until closed."""

    def __init__(self, weights: str):
        real = os.path.realpath(weights)
        entry = fp._entry_path(fp.stat_key(real, os.stat(real)))
        lock = entry[: -len(".json")] + ".lock"
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        code = (
            "import fcntl, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "sys.stdin.read()\n"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, lock], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert self.proc.stdout.readline() == b"held\n"

    def holding(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def returns(fn, *args, timeout: float = 60.0):
    """``fn(*args)``, called on a thread: (True, its result) when it returned
    within ``timeout`` (a liveness bound, far above what it takes), else
    (False, None): it is blocked."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)), daemon=True)
    thread.start()
    thread.join(timeout)
    return (True, result[0]) if result else (False, None)


def test_an_adapter_saved_every_step_is_hashed_off_the_scheduler_thread(tmp_path, monkeypatch):
    """An RL loop saves the adapter while its requests arrive: every save is
    hashed again (written within the last two seconds), never on the thread
    that calls the scheduler; its first request is a miss, and once the
    thread sees a save the adapter is not cached again."""
    from vllm.lora.request import LoRARequest

    from helpers.scheduler_harness import kvbm, make_request, make_scheduler, tokens

    adapter = tmp_path / "adapter"
    hashed_on = []  # the threads that hashed the adapter's files
    real = fp.hash_file

    def recording(path):
        if str(adapter) in path:
            hashed_on.append(threading.current_thread().name)
        return real(path)

    monkeypatch.setattr(fp, "hash_file", recording)

    lora = LoRARequest("rl", 1, str(adapter))
    k = kvbm(make_scheduler(host_blocks=16))
    prompt = tokens(3 * 128 + 5, 97)
    tracked = []
    for step in range(4):
        save_adapter(adapter, step)
        for _ in range(3):
            request = make_request(prompt, lora_request=lora)
            assert k.get_num_new_matched_tokens(request, 0) == (0, False)
            tracked.append(request.request_id in k._reqs)
        assert threading.current_thread().name not in hashed_on, "hashed by the caller"
        assert k.adapters.fingerprints.settled(60)  # the next save comes later
    assert hashed_on, "the adapter thread hashed the saves"
    assert set(hashed_on) == {"kvbm-lora-fingerprints"}
    assert not any(tracked[:3])  # not fingerprinted yet: a miss
    # Named by the thread's last check (the save before: if vLLM loads other
    # weights for it, the workers refuse its jobs, worker/lora_loads.py).
    assert tracked[3]
    assert not any(tracked[6:])  # the thread saw a new save: not cached again
    after = make_request(prompt, lora_request=lora)
    k.get_num_new_matched_tokens(after, 0)
    assert after.request_id not in k._reqs


def test_a_request_while_another_process_holds_the_digest_lock_is_a_miss(tmp_path):
    """The adapter thread waits for the lock; the scheduler's call does not:
    it returns a miss while the other process still holds it, and once the
    lock is free the adapter is fingerprinted and cached."""
    from vllm.lora.request import LoRARequest

    from helpers.scheduler_harness import fingerprinted, kvbm, make_request, make_scheduler, tokens

    adapter = save_adapter(tmp_path / "adapter", 0)
    lora = LoRARequest("a", 1, adapter)
    k = kvbm(make_scheduler(host_blocks=16))
    prompt = tokens(3 * 128 + 5, 98)
    holder = FlockHolder(os.path.join(adapter, "adapter_model.safetensors"))
    try:
        request = make_request(prompt, lora_request=lora)
        done, answer = returns(k.get_num_new_matched_tokens, request, 0)
        assert done, "the scheduler's call waited for another process's lock"
        assert answer == (0, False) and request.request_id not in k._reqs
        assert holder.holding()
    finally:
        holder.close()
    fingerprinted(k, lora)
    later = make_request(prompt, lora_request=lora)
    k.get_num_new_matched_tokens(later, 0)
    assert k._reqs[later.request_id].adapter == (1, fp.adapter_fingerprint(adapter))


def test_a_digest_lock_held_by_another_process_is_waited_for_until_the_deadline(
    tmp_path, monkeypatch, caplog
):
    """Past LOCK_TIMEOUT_S the file is hashed here, uncached, with one warning."""
    monkeypatch.setattr(fp, "LOCK_TIMEOUT_S", 0.3, raising=False)
    monkeypatch.setattr(fp, "_warned_locked", False, raising=False)
    weights = os.path.join(save_adapter(tmp_path / "model", 3), "adapter_model.safetensors")
    holder = FlockHolder(weights)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm_kvbm.fingerprints"):
            done, digest = returns(fp.file_digest, weights)
            assert done, "file_digest waited past its deadline for another process's lock"
            fp.clear_memory_cache()
            assert returns(fp.file_digest, weights)[0]
        assert holder.holding()
    finally:
        holder.close()
    assert digest == fp.hash_file(weights)
    assert caplog.text.count("held the digest cache lock") == 1
    assert not list((tmp_path / "kvbm-cache" / "fingerprints").glob("*.json"))  # uncached
