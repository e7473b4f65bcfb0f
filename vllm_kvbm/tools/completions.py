"""Streamed completions from an OpenAI-compatible server, through the openai client.

The one streaming client of the demo, kvbm-bench, the benchmarks and the tests.
The openai client (installed with vLLM) parses the server-sent events and raises
on an HTTP error or an error event; what it cannot know is timed here: the
``perf_counter`` at which each chunk holding a token was handed over (the first
is the time to first token, the gaps the inter-token latency) and how many
tokens each held (vLLM's ``return_token_ids``; one without it). A record is
filled as the stream runs, so a caller can watch a stream still decoding.
Requests are greedy with ``ignore_eos`` (vLLM's extension, in ``extra_body``),
never retried (a retry would be timed as one slow request).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field


@dataclass
class Streamed:
    """One streamed completion, as it arrives."""

    sent: float  # perf_counter when sent
    launch: float = 0.0  # unix time when sent
    stamps: list[float] = field(default_factory=list)  # perf_counter per chunk with tokens
    tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # with return_token_ids
    prompt_tokens: int | None = None  # the usage, when the server sent it
    completion_tokens: int | None = None
    end: float | None = None  # perf_counter when the stream ended
    done: bool = False

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.sent

    @property
    def total(self) -> float:
        return (self.end if self.end is not None else time.perf_counter()) - self.sent


def _api_key() -> str:
    # vLLM checks a key only when started with --api-key; the client needs one
    return os.environ.get("OPENAI_API_KEY") or "EMPTY"


def async_client(base_url: str, timeout: float = 600, http_client=None):
    """An ``AsyncOpenAI`` for ``base_url`` (the server's root, without /v1)."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(
        base_url=f"{base_url.rstrip('/')}/v1",
        api_key=_api_key(),
        max_retries=0,
        timeout=timeout,
        http_client=http_client,
    )


def sync_client(base_url: str, timeout: float = 600):
    from openai import OpenAI

    return OpenAI(
        base_url=f"{base_url.rstrip('/')}/v1", api_key=_api_key(), max_retries=0, timeout=timeout
    )


def _request(model: str, prompt, max_tokens: int, token_ids: bool) -> dict:
    extra = {"ignore_eos": True}
    if token_ids:
        extra["return_token_ids"] = True
    return dict(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )


def _take(out: Streamed, chunk) -> None:
    """Records one chunk: its usage, and its tokens with the time they came."""
    now = time.perf_counter()
    if chunk.usage is not None:
        out.prompt_tokens = chunk.usage.prompt_tokens
        out.completion_tokens = chunk.usage.completion_tokens
    for choice in chunk.choices or ():
        ids = getattr(choice, "token_ids", None)
        n = len(ids) if ids is not None else 1
        out.text.append(choice.text or "")
        out.token_ids.extend(ids or ())
        if n:  # the last chunk of a stream may carry no new token
            out.stamps.append(now)
            out.tokens.append(n)


def _finish(out: Streamed) -> Streamed:
    out.end = time.perf_counter()
    out.done = True
    if not out.stamps:
        raise RuntimeError("the stream ended without a token")
    return out


async def stream_into(
    client,
    model: str,
    prompt,
    max_tokens: int,
    out: Streamed,
    timeout: float = 600,
    token_ids: bool = False,
) -> Streamed:
    """Streams one completion into ``out``; the whole request is bounded by
    ``timeout`` seconds (TimeoutError). Cancelling it closes the connection,
    which makes vLLM abort the request."""
    out.launch = time.time() - (time.perf_counter() - out.sent)
    async with asyncio.timeout(timeout):
        stream = await client.completions.create(**_request(model, prompt, max_tokens, token_ids))
        async with stream:
            async for chunk in stream:
                _take(out, chunk)
    return _finish(out)


async def stream(
    client, model: str, prompt, max_tokens: int, timeout: float = 600, token_ids: bool = False
) -> Streamed:
    return await stream_into(
        client, model, prompt, max_tokens, Streamed(time.perf_counter()), timeout, token_ids
    )


def stream_sync(
    base_url: str,
    model: str,
    prompt,
    max_tokens: int,
    timeout: float = 600,
    token_ids: bool = False,
) -> Streamed:
    """The same without an event loop; ``timeout`` bounds each read."""
    with sync_client(base_url, timeout) as client:
        out = Streamed(time.perf_counter())
        out.launch = time.time()
        with client.completions.create(**_request(model, prompt, max_tokens, token_ids)) as chunks:
            for chunk in chunks:
                _take(out, chunk)
    return _finish(out)
