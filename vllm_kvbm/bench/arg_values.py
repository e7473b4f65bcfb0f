"""``kvbm-bench``'s argument values, each checked where it is parsed: a bad
one is an ``argparse`` error that says what to give, with an example."""

from __future__ import annotations

import argparse
import re


def _number(kind, text: str, lowest, inclusive: bool, example: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a {'whole number' if kind is int else 'number'}; e.g. {example}"
        ) from None
    if value < lowest or (value == lowest and not inclusive):
        bound = f"{lowest} or more" if inclusive else f"more than {lowest}"
        raise argparse.ArgumentTypeError(f"must be {bound} (got {text}); e.g. {example}")
    return value


def count(example: str, lowest: int = 1):
    """A whole number of at least ``lowest``."""

    def parse(text: str) -> int:
        return _number(int, text, lowest, True, example)

    parse.__name__ = "whole number"
    return parse


def positive(example: str):
    """A number above 0 (seconds, requests per second)."""

    def parse(text: str) -> float:
        return _number(float, text, 0, False, example)

    parse.__name__ = "number"
    return parse


def fraction(text: str) -> float:
    value = _number(float, text, 0, True, "0.5")
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (got {text}); e.g. 0.5")
    return value


def size(text: str) -> str:
    """A byte size as KVBM reads it (``1GiB``, ``512MiB``)."""
    from vllm_kvbm.config import parse_size

    try:
        parse_size("size", text)
    except ValueError as err:  # "size: cannot read ...; write it like 16GiB, ..."
        raise argparse.ArgumentTypeError(str(err).partition(": ")[2]) from None
    return text


def base_url(text: str) -> str:
    if not re.match(r"^https?://[^/\s]+", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an http(s) URL; give the server's root, e.g. "
            "http://127.0.0.1:8000 (without /v1)"
        )
    return text.rstrip("/").removesuffix("/v1")


def named_url(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give NAME=URL, NAME of letters, digits, '.', '_' or '-' (it names "
            "the report's row and files), e.g. kvbm=http://127.0.0.1:8000"
        )
    return name, base_url(url)
