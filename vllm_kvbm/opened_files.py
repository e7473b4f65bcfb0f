"""The weight files vLLM's loader picked in this process, as it picked them.

KVBM hashes a model's files once the engine is up, after vLLM loaded them
(fingerprints.model_fingerprint). A checkpoint link moved, or a file
rewritten, between vLLM's read and that hash would key one model's KV by
another's files. So every process vLLM starts records, as vLLM's
``DefaultModelLoader`` picks the files it is about to read (its
``_prepare_weights``: the hf, safetensors, fastsafetensors, instanttensor,
mistral, pt and npcache formats), each file's path, real path and stat; the
fingerprint then refuses files other than those, or changed since
(``moved``). The worker also learns from it which files a ``reload_weights``
read (worker/loaded_weights.py).

Installed by the vLLM plugin (plugin.py) in every process before vLLM loads
a model; the loader's module is patched when it is first imported, so a
process that never loads a model pays nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from vllm_kvbm.on_import import when_imported

logger = logging.getLogger(__name__)

LOADER_MODULE = "vllm.model_executor.model_loader.default_loader"
_KEEP = 64  # selections kept (each reload adds one)


@dataclass(frozen=True)
class Selection:
    """One pick of weight files by vLLM's loader."""

    source: str  # the model or path vLLM was asked for
    folder: str  # the directory it read, as it named it
    folder_real: str  # that directory's real path when the files were picked
    # (path as vLLM opens it, its real path, its stat key) per weight file
    files: tuple[tuple[str, str, tuple], ...]


_lock = threading.Lock()
_selections: list[Selection] = []
_count = 0


def stat_key(real: str) -> tuple:
    st = os.stat(real)
    return (real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def record(source: str, folder: str, paths: list[str]) -> None:
    """vLLM picked ``paths`` in ``folder`` to load ``source``'s weights."""
    global _count
    files = []
    for path in paths:
        try:
            real = os.path.realpath(path)
            files.append((path, real, stat_key(real)))
        except OSError:
            files.append((path, "", ()))  # vLLM will fail to read it too
    selection = Selection(str(source), str(folder), os.path.realpath(folder), tuple(files))
    with _lock:
        _selections.append(selection)
        del _selections[:-_KEEP]
        _count += 1


def count() -> int:
    """How many selections this process recorded so far (``since``'s mark)."""
    with _lock:
        return _count


def since(mark: int) -> list[Selection]:
    """The selections recorded after ``count()`` returned ``mark``."""
    with _lock:
        new = _count - mark
        return list(_selections[-new:]) if 0 < new <= len(_selections) else []


def latest(source: str) -> Selection | None:
    """The last pick of ``source``'s files in this process (None: none
    recorded: another loader, or a process that loads no weights)."""
    with _lock:
        return next((s for s in reversed(_selections) if s.source == str(source)), None)


def moved(selection: Selection) -> str | None:
    """Why the files ``selection`` names may not be those vLLM read (a path
    that now resolves elsewhere, a file written since), or None."""
    if os.path.realpath(selection.folder) != selection.folder_real:
        return f"{selection.folder} now leads to {os.path.realpath(selection.folder)}"
    for path, real, key in selection.files:
        try:
            if os.path.realpath(path) != real or stat_key(real) != key:
                return f"{path} changed after vLLM picked it"
        except OSError:
            return f"{path} is gone"
    return None


def reset() -> None:
    """Forgets every selection (tests)."""
    global _count
    with _lock:
        _selections.clear()
        _count = 0


# ---- vLLM's loader -----------------------------------------------------------------


def _patch(module) -> None:
    loader = getattr(module, "DefaultModelLoader", None)
    prepare = getattr(loader, "_prepare_weights", None)
    if prepare is None or getattr(prepare, "__kvbm_recorded__", False):
        return

    def _prepare_weights(self, model_name_or_path, *args, **kwargs):
        out = prepare(self, model_name_or_path, *args, **kwargs)
        try:
            subfolder = args[0] if args else kwargs.get("subfolder")
            if subfolder is None:  # the model's own files (not a secondary source's)
                record(model_name_or_path, out[0], list(out[1]))
        except Exception as err:  # noqa: BLE001 - never fail vLLM's load over a record
            logger.warning("KVBM: cannot record the weight files vLLM picked (%s)", err)
        return out

    _prepare_weights.__kvbm_recorded__ = True
    _prepare_weights.__wrapped__ = prepare
    loader._prepare_weights = _prepare_weights


def install() -> None:
    """Records vLLM's weight file picks in this process from now on."""
    when_imported(LOADER_MODULE, _patch)
