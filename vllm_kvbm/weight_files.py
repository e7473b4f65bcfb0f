"""Which files of a model vLLM reads its weights from, by load format.

A page's key names the model's weights by a hash of their files
(fingerprints.model_fingerprint), so it must hash the files vLLM loaded:
the directory vLLM reads (a local path, or the HF snapshot in
``--download-dir`` when it is set, not the default HF cache where only
``config.json`` may lie), the weight files its ``--load-format`` reads
there (vLLM 0.32's model_loader/default_loader.py: the first pattern that
matches any file wins), and with ``--trust-remote-code`` the modelling code
next to them. A superset of what vLLM reads is safe (the key changes more
often than needed), a subset is not.

Loaders that read no files KVBM can see (``dummy``: random weights;
``tensorizer``, ``runai_streamer``, ``modelexpress``, ``ipc_cache``: other
stores or processes; a loader registered by a plugin) and a directory with
no weight files give ``None``: nothing proves which weights the engine runs.
"""

from __future__ import annotations

import fnmatch
import os

# The patterns each load format reads, in vLLM's order of preference.
_HF = ("*.safetensors", "*.bin", "*.pt")
FORMAT_PATTERNS = {
    "hf": _HF,
    "safetensors": ("*.safetensors",),
    "fastsafetensors": ("*.safetensors",),
    "instanttensor": ("*.safetensors",),
    "mistral": ("consolidated*.safetensors",),
    "pt": ("*.pt",),
    "npcache": ("*.bin", "*.pt"),  # converted to numpy files from the .bin ones
    # each rank's shards: every rank's are hashed (a superset)
    "sharded_state": ("*.safetensors",),
    "runai_streamer_sharded": ("*.safetensors",),
    "gguf": ("*.gguf",),  # vLLM releases with a GGUF loader
}
# Files besides the weights that decide the KV for given token ids (the HF
# config as vLLM runs it is also in the keys: identity_fields.py).
CONFIG_FILES = ("config.json", "params.json")
INDEX_SUFFIX = ".index.json"


def load_format_of(load_format: str, directory: str) -> str:
    """vLLM's ``auto``: ``mistral`` where consolidated safetensors are, else ``hf``."""
    if load_format != "auto":
        return load_format
    names = os.listdir(directory)
    return "mistral" if fnmatch.filter(names, "consolidated*.safetensors") else "hf"


def weight_files(directory: str, load_format: str) -> list[str] | None:
    """The names of the weight files ``load_format`` reads in ``directory``;
    None when KVBM cannot tell (a format it does not know) or there are none."""
    patterns = FORMAT_PATTERNS.get(load_format_of(load_format, directory))
    if patterns is None:
        return None
    names = sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n)))
    for pattern in patterns:
        found = fnmatch.filter(names, pattern)
        if found:
            return found
    return None


def model_files(directory: str, load_format: str, remote_code: bool) -> list[str] | None:
    """What identifies the weights vLLM reads from ``directory``: its weight
    files, their index, its config and, with ``remote_code``, its ``*.py``
    modelling code. None when no weight file can be named."""
    weights = weight_files(directory, load_format)
    if weights is None:
        return None
    names = [n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n))]
    extra = {
        n
        for n in names
        if n in CONFIG_FILES or n.endswith(INDEX_SUFFIX) or (remote_code and n.endswith(".py"))
    }
    return sorted(extra | set(weights))
