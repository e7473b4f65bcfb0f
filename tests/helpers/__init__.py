"""Modules shared by the tests (tests/unit, tests/e2e) and some benchmarks.

Imported as ``from helpers.engines import make_llm``: pyproject's pytest
``pythonpath`` puts tests/ on sys.path. Fixtures live in tests/conftest.py.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Real `vllm serve` logs the core checks read.
DATA = ROOT / "tests" / "data"
