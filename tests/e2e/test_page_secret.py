"""The page secret: the codec seals pages with it (AES-256-GCM, a fresh nonce
each) and every forgery built as an attacker would (test_page_auth's helpers)
is unauthenticated, damage is corrupt; and the secret's file and variable,
whose errors name the key and never show the secret.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from helpers.tier_pages import SMALL, key, page, restamp  # noqa: E402
from test_page_auth import NS, OTHER, SECRET, _header_fields, decode, encoded, v1_page  # noqa: E402
from vllm_kvbm.config import KVBMConfigError, load_config  # noqa: E402
from vllm_kvbm.config.secrets import MIN_PAGE_SECRET_BYTES  # noqa: E402
from vllm_kvbm.tiers import page_format as pf  # noqa: E402
from vllm_kvbm.tiers.page_codec import PageCodec  # noqa: E402
from vllm_kvbm.tiers.page_format import HEADER_BYTES  # noqa: E402
from vllm_kvbm.tiers.page_names import page_name  # noqa: E402
from vllm_kvbm.tiers.page_seal import MIN_SECRET_BYTES  # noqa: E402


# ---- the codec -----------------------------------------------------------------


def test_keyed_pages_round_trip_and_every_forgery_is_unauthenticated():
    keyed, plain, other = (
        PageCodec(NS, SMALL, SECRET),
        PageCodec(NS, SMALL),
        PageCodec(NS, SMALL, OTHER),
    )
    p, q = page(1, SMALL), page(2, SMALL)
    k = key(1)
    out = torch.empty(SMALL, dtype=torch.uint8)
    genuine = encoded(keyed, k, p)
    assert len(genuine) == HEADER_BYTES + SMALL == keyed.stored_bytes
    assert decode(keyed, genuine, k, out) == "ok" and torch.equal(out, p)

    forgeries = {
        # written by an engine (or an attacker) without the secret
        "no secret": encoded(plain, k, q),
        # written with another deployment's secret
        "other secret": encoded(other, k, q),
        # a made-up seal field: random nonce and tag
        "random seal": restamp(genuine, mac=os.urandom(28) + bytes(4)),
        # another page's ciphertext under the genuine seal field
        "ciphertext transplanted": restamp(genuine, payload=encoded(keyed, k, q)[HEADER_BYTES:]),
        # the genuine ciphertext presented as a page in the clear
        "seal stripped": restamp(genuine, flags=0, mac_alg=0, mac=bytes(32), key_field=k),
        # namespace B's genuine page (same secret) relabelled with A's header
        # hash: the seal binds the full namespace, not its 8-byte hash
        "other namespace": restamp(
            encoded(PageCodec("model-b", SMALL, SECRET), k, q), ns8=keyed.ns8
        ),
    }
    for what, data in forgeries.items():
        # every one passes the integrity checks (a valid CRC), and none is accepted
        assert decode(keyed, data, k, out) == "unauthenticated", what
    # The genuine page filed under another key does not open either.
    assert decode(keyed, genuine, key(2), out) == "unauthenticated"


def test_pages_are_sealed_with_aes_gcm_and_a_fresh_nonce_each():
    keyed = PageCodec(NS, SMALL, SECRET)
    k, p = key(5), page(5, SMALL)
    out = torch.empty(SMALL, dtype=torch.uint8)
    a, b = encoded(keyed, k, p), encoded(keyed, k, p)
    assert _header_fields(a)[4] == pf.MAC_AES_GCM and _header_fields(a)[3] & pf.FLAG_SEALED
    assert a[pf.MAC_OFF : pf.MAC_OFF + 12] != b[pf.MAC_OFF : pf.MAC_OFF + 12]  # nonces differ
    assert a[HEADER_BYTES:] != b[HEADER_BYTES:]
    assert decode(keyed, a, k, out) == "ok" and decode(keyed, b, k, out) == "ok"
    assert torch.equal(out, p)
    # v2's algorithms are not accepted in this version's header.
    for alg in (pf.MAC_BLAKE3, pf.MAC_GMAC):
        assert decode(keyed, restamp(a, mac_alg=alg), k, out) == "corrupt"


def test_damage_is_corrupt_not_unauthenticated_and_the_header_stays_strict():
    keyed = PageCodec(NS, SMALL, SECRET)
    k, p = key(3), page(3, SMALL)
    out = torch.empty(SMALL, dtype=torch.uint8)
    genuine = bytearray(encoded(keyed, k, p))
    flipped = bytearray(genuine)
    flipped[HEADER_BYTES + 10] ^= 1
    assert decode(keyed, bytes(flipped), k, out) == "corrupt"  # damage, not an attack
    mac_off = pf.MAC_OFF
    flipped = bytearray(genuine)
    flipped[mac_off + 3] ^= 1  # the MAC itself: the CRC covers it
    assert decode(keyed, bytes(flipped), k, out) == "corrupt"
    # A verified seal proves the bytes intact, so the CRC is then not computed:
    # a flipped CRC field fails only a reader without the secret.
    flipped = bytearray(genuine)
    flipped[pf.CRC_OFF] ^= 1
    assert decode(keyed, bytes(flipped), k, out) == "ok" and torch.equal(out, p)
    assert decode(PageCodec(NS, SMALL), bytes(flipped), k, out) == "corrupt"
    plain_page = encoded(PageCodec(NS, SMALL), k, p)
    # Inconsistent MAC fields are malformed, whoever reads them.
    for bad in (
        restamp(plain_page, mac=b"\x01" * 32),  # no flag, a MAC
        restamp(plain_page, mac_alg=pf.MAC_BLAKE3),  # no flag, an algorithm
        restamp(bytes(genuine), mac_alg=7),  # unknown algorithm
        restamp(bytes(genuine), flags=pf.FLAG_MAC | 8),
    ):  # unknown flag
        for codec in (keyed, PageCodec(NS, SMALL)):
            assert decode(codec, bad, k, out) == "corrupt"
    # Format version 1 pages are refused, never misread, with or without a secret.
    old = v1_page(NS, SMALL, k, p)
    for codec in (keyed, PageCodec(NS, SMALL)):
        assert decode(codec, old, k, out) == "corrupt"
        assert decode(codec, old + bytes(32), k, out) == "corrupt"  # even at v2's length
    assert page_name(NS, SMALL, 0, 1, k).split("@")[0] not in pf.retired_model_names(NS, SMALL)


def test_tombstones_are_sealed_too():
    keyed, plain = PageCodec(NS, SMALL, SECRET), PageCodec(NS, SMALL)
    out = torch.empty(SMALL, dtype=torch.uint8)
    for codec in (keyed, plain):
        buf = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        codec.encode_tombstone(buf, key(4))
        data = buf.numpy().tobytes()
        assert decode(codec, data, key(4), out) == "miss"
        other = plain if codec is keyed else keyed
        assert decode(other, data, key(4), out) == "unauthenticated"


def test_an_engine_without_a_secret_refuses_sealed_pages_and_warns_once(caplog):
    keyed, plain = PageCodec(NS, SMALL, SECRET), PageCodec(NS, SMALL)
    out = torch.empty(SMALL, dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm.tiers.page_codec"):
        for i in range(3):
            data = encoded(keyed, key(i), page(i, SMALL))
            assert decode(plain, data, key(i), out) == "unauthenticated"
    warnings = [
        r.getMessage() for r in caplog.records if "sealed with a page secret" in r.getMessage()
    ]
    assert len(warnings) == 1 and "page_secret_file" in warnings[0]
    assert keyed.keyed and not plain.keyed


def test_the_secret_is_never_printed_and_short_secrets_are_refused():
    codec = PageCodec(NS, SMALL, SECRET)
    assert SECRET.decode() not in repr(codec.__dict__) and SECRET.hex() not in repr(codec.__dict__)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        PageCodec(NS, SMALL, b"short")
    assert MIN_PAGE_SECRET_BYTES == MIN_SECRET_BYTES


# ---- configuration -----------------------------------------------------------------


def _err(extra, environ=None) -> str:
    with pytest.raises(KVBMConfigError) as info:
        load_config(extra, environ or {})
    return str(info.value)


def test_secret_file_and_env(tmp_path, caplog):
    path = tmp_path / "page.secret"
    path.write_bytes(SECRET + b"\n")  # a trailing newline is not part of the secret
    with caplog.at_level(logging.DEBUG):
        cfg = load_config({"page_secret_file": str(path)}, {})
        env_cfg = load_config({}, {"KVBM_PAGE_SECRET_FILE": str(path)})
        text_cfg = load_config({}, {"KVBM_PAGE_SECRET": SECRET.decode()})
    assert cfg.page_secret.reveal() == env_cfg.page_secret.reveal() == SECRET
    assert text_cfg.page_secret.reveal() == SECRET and cfg.page_secret == text_cfg.page_secret
    assert load_config({}, {}).page_secret is None
    for shown in (
        repr(cfg),
        str(cfg),
        repr(cfg.page_secret),
        str(cfg.page_secret),
        repr(text_cfg),
        caplog.text,
    ):
        assert SECRET.decode() not in shown and SECRET.hex() not in shown
    assert "page_secret" not in repr(cfg)  # the field is left out of the config's repr


def test_bad_secret_files_are_startup_errors_naming_the_key_and_the_fix(tmp_path):
    cases = {}
    cases["missing"] = (str(tmp_path / "nope"), "does not exist")
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    cases["empty"] = (str(empty), "is empty")
    newline = tmp_path / "newline"
    newline.write_bytes(b"\n")
    cases["only a newline"] = (str(newline), "is empty")
    short = tmp_path / "short"
    short.write_bytes(b"kvbm-secret\n")
    cases["too short"] = (str(short), "shorter than 16 bytes")
    cases["a directory"] = (str(tmp_path), "is a directory")
    loop = tmp_path / "loop"
    os.symlink(loop, loop)  # reading it fails for real, even as root
    cases["unreadable"] = (str(loop), "cannot read")
    for what, (path, fragment) in cases.items():
        msg = _err({"page_secret_file": path})
        assert msg.startswith("page_secret_file: "), (what, msg)
        assert fragment in msg and repr(path) in msg, (what, msg)
        if fragment != "cannot read":
            assert "head -c 32 /dev/urandom" in msg, (what, msg)
        assert "kvbm-secret" not in msg  # the short file's content is never shown
        env_msg = _err({}, {"KVBM_PAGE_SECRET_FILE": path})
        assert env_msg.startswith("KVBM_PAGE_SECRET_FILE (sets page_secret_file: "), env_msg
    if os.geteuid() != 0:  # root reads a file whatever its mode
        locked = tmp_path / "locked"
        locked.write_bytes(SECRET)
        locked.chmod(0)
        assert "cannot read" in _err({"page_secret_file": str(locked)})
    assert _err({"page_secret_file": 5}).startswith("page_secret_file: expected the path")


def test_secret_env_errors_never_show_the_secret(tmp_path):
    msg = _err({}, {"KVBM_PAGE_SECRET": "hunter2"})
    assert msg.startswith("KVBM_PAGE_SECRET") and "16 bytes" in msg and "hunter2" not in msg
    path = tmp_path / "s"
    path.write_bytes(SECRET)
    msg = _err({"page_secret_file": str(path)}, {"KVBM_PAGE_SECRET": OTHER.decode()})
    assert "set only one" in msg and OTHER.decode() not in msg and SECRET.decode() not in msg
    # Inline secrets are not a key (vLLM logs kv_connector_extra_config).
    msg = _err({"page_secret": OTHER.decode()})
    assert "unknown key 'page_secret'" in msg and "page_secret_file" in msg
    assert OTHER.decode() not in msg
