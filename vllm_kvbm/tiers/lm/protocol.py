"""The one message of LMCache's ``lm://`` wire protocol the scheduler sends: EXIST.

The scheduler asks the server whether a page exists without importing LMCache
(which is heavy and starts threads and devices of its own); the worker side
talks to the server through LMCache's own connector. The layout is LMCache
0.5.6's ``ClientMetaMessage`` / ``ServerMetaMessage`` (v1/protocol.py); a
test checks it byte for byte against LMCache's own serializer.
"""

from __future__ import annotations

import struct

MAX_KEY_LENGTH = 150
_REQUEST = struct.Struct(f"iiiiiiiii{MAX_KEY_LENGTH}s")
_REPLY = struct.Struct("iiiiiiiii")
REPLY_BYTES = _REPLY.size
_EXIST = 3  # ClientCommand.EXIST
_FMT_KV_2LTD = 1  # MemoryFormat(1), what LMCache's own EXIST sends
_DTYPE_FLOAT16 = 2  # DTYPE_TO_INT[torch.float16], likewise
_SUCCESS = 200  # ServerReturnCode.SUCCESS


def exist_request(name: str) -> bytes:
    """The EXIST request for a page stored under ``name`` (see page_names.page_name)."""
    raw = name.encode()
    if len(raw) > MAX_KEY_LENGTH:
        raise ValueError(f"page name longer than {MAX_KEY_LENGTH} bytes: {name!r}")
    return _REQUEST.pack(
        _EXIST, 0, _FMT_KV_2LTD, _DTYPE_FLOAT16, 0, 0, 0, 0, 0, raw.ljust(MAX_KEY_LENGTH)
    )


def exist_reply(data: bytes) -> bool:
    """True if the server's reply says the page exists."""
    return _REPLY.unpack(data)[0] == _SUCCESS
