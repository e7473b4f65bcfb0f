"""What a `vllm serve` log says went wrong: its error lines, and the root cause
of a failed start (read by ``kvbm-bench compare``)."""

from __future__ import annotations

import re
from pathlib import Path


def log_errors(path: Path, limit: int = 6, fallback: bool = True) -> str:
    """The distinct error lines of a server log, last ones first in importance.
    Lines vLLM logs at DEBUG, INFO or WARNING are notices, not errors, even
    when they quote an exception ('Failed to create oneDNN linear, fallback
    to torch linear. Exception: ...' on CPUs without native bf16)."""
    keys = ("Error", "ERROR", "error:", "No supported", "not supported", "Exception")
    seen: list[str] = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in lines:
        if "[shutdown]" in line:
            break  # what follows is the stop this runner asked for
        plain = re.sub(r"\x1b\[[0-9;]*m", "", line)
        level = _LOG_PREFIX.match(plain).group(3)
        if level in ("DEBUG", "INFO", "WARNING"):
            continue
        text = plain.split("] ", 1)[-1].strip()
        if any(k in text for k in keys) and text not in seen:
            seen.append(text[:400])
    return "\n".join(seen[-limit:]) or ("\n".join(lines[-limit:]) if fallback else "")


_LOG_PREFIX = re.compile(
    r"^(\([\w ]+ pid=\d+\)\s*)?((DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"\d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\]\s*)?"
)
_RAISED = re.compile(r"^((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Exit)): (.+)")
# vLLM's wrappers around a worker's or the engine core's exception: they name
# no cause of their own
_WRAPPERS = (
    "Worker failed with error",
    "Engine core initialization failed",
    "See root cause above",
    "check the stack trace above",
)


def startup_error(path: Path) -> str:
    """The line of a server log that says why the server did not start: the
    first exception raised that is not one of vLLM's wrappers around it
    ('Exception: CPU Offloading is currently only supported on CUDA-alike and
    XPU GPUs'), else the first wrapper, else ''."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    wrapped = ""
    for line in lines:
        text = _LOG_PREFIX.sub("", re.sub(r"\x1b\[[0-9;]*m", "", line)).strip()
        m = _RAISED.match(text)
        if not m:
            continue
        if not any(w in text for w in _WRAPPERS):
            return text[:400]
        wrapped = wrapped or text[:400]
    return wrapped
