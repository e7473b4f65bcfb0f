"""Patches a vLLM module in this process as soon as it is imported.

The plugin runs in every process vLLM starts, often before the module it
wraps is imported (and in processes that never import it: those pay
nothing). ``patch`` must be idempotent: it may see a module twice.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType


def when_imported(name: str, patch: Callable[[ModuleType], None]) -> None:
    """``patch(module)`` now if ``name`` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, PatchOnImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, PatchOnImport(name, patch))


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of one module so that ``patch`` runs after it."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]):
        self.name = name
        self.patch = patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # the real finders find it; we only wrap
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec
