"""Requests whose KV depends on more than token ids: images, audio, prompt embeddings.

Such a request is cached only under keys that name those inputs: vLLM's
SHA-256 block hashes, which the connector checks once (on probe requests)
to change with a multimodal item's identifier (the content hash vLLM's
processor gives it) and with the embeddings. Its own token chain names
token ids only: under it such requests are neither looked up nor stored.
Driven by vLLM's real Scheduler (no model: the text model's scheduler has no
encoder budget, so requests with images are looked up, not run).
"""

from __future__ import annotations

import torch
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

from helpers.scheduler_harness import (
    BLOCK,
    kvbm,
    lookup,
    make_request,
    make_scheduler,
    store_and_finish,
    tokens,
)


def image(name: str, offset: int) -> list[MultiModalFeatureSpec]:
    return [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=name,
            mm_position=PlaceholderRange(offset=offset, length=BLOCK),
        )
    ]


def keys(k, req) -> list[bytes]:
    return list(k.key_chain(req).extend(req.all_token_ids))


def test_same_text_and_another_image_never_share_a_page_after_the_image():
    k = kvbm(make_scheduler())
    text = tokens(4 * BLOCK + 3, base=961)
    at = BLOCK + 2  # the image starts in the second block
    plain = keys(k, make_request(text))
    a = keys(k, make_request(text, mm_features=image("image-a", at)))
    a2 = keys(k, make_request(text, mm_features=image("image-a", at)))
    b = keys(k, make_request(text, mm_features=image("image-b", at)))
    moved = keys(k, make_request(text, mm_features=image("image-a", at + BLOCK)))
    assert len(a) == 4 and a == a2  # the same image names the same pages
    assert a[0] == b[0] == plain[0]  # the block before the image is the text's
    for i in range(1, 4):  # the image's block and every later one (chained)
        assert len({a[i], b[i], plain[i]}) == 3, i
    assert moved[1] == plain[1] and moved[2] != a[2]  # where the image sits counts too


def test_a_request_with_an_image_is_looked_up_and_finds_only_the_text_before_it():
    sched = make_scheduler()
    k = kvbm(sched)
    text = tokens(3 * BLOCK + 5, base=962)
    store_and_finish(sched, text)  # the same token ids, as text
    assert sched.reset_prefix_cache()
    req = make_request(text, mm_features=image("image-a", BLOCK + 2))
    assert lookup(k, req)[0] == BLOCK  # its pages after the image are its own
    state = k._reqs[req.request_id]
    assert state.params.loads and state.params.stores and not state.no_store


def test_prompt_embeddings_are_keyed_by_their_values():
    k = kvbm(make_scheduler())
    gen = torch.Generator().manual_seed(5)
    embeds = torch.randn(3 * BLOCK + 1, 16, generator=gen)
    other = embeds.clone()
    other[2 * BLOCK + 1, 3] += 0.5  # one value in the third block
    a = keys(k, make_request(None, prompt_embeds=embeds))
    a2 = keys(k, make_request(None, prompt_embeds=embeds.clone()))
    b = keys(k, make_request(None, prompt_embeds=other))
    assert len(a) == 3 and a == a2
    assert a[:2] == b[:2] and a[2] != b[2]
    req = make_request(None, prompt_embeds=embeds)
    assert lookup(k, req) == (0, False) and req.request_id in k._reqs


def test_embeddings_mixed_with_token_ids_are_not_cached():
    k = kvbm(make_scheduler())
    n = 2 * BLOCK + 1
    req = make_request(
        tokens(n, base=963),
        prompt_embeds=torch.randn(n, 16),
        prompt_is_token_ids=[i % 2 == 0 for i in range(n)],
    )
    assert lookup(k, req) == (0, False)
    assert req.request_id not in k._reqs


def test_under_the_connectors_own_chain_images_and_embeddings_are_not_cached():
    # xxhash: vLLM's hashes do not qualify, keys come from a chain over token ids.
    sched = make_scheduler(hash_algo="xxhash")
    k = kvbm(sched)
    text = tokens(3 * BLOCK + 5, base=964)
    store_and_finish(sched, text)
    assert sched.reset_prefix_cache()
    with_image = make_request(text, mm_features=image("image-a", BLOCK + 2))
    assert lookup(k, with_image) == (0, False)
    assert with_image.request_id not in k._reqs  # nothing looked up or stored
    embeds = make_request(None, prompt_embeds=torch.randn(2 * BLOCK + 1, 16))
    assert lookup(k, embeds) == (0, False) and embeds.request_id not in k._reqs


def _session_adds_an_image(hash_algo: str):
    """A streaming-input session (vLLM's resumable requests) begins as text and
    adds an image in a later chunk (``Scheduler._update_request_as_session``
    extends ``mm_features``): its state, made while it was text, is judged again."""
    sched = make_scheduler(hash_algo=hash_algo)
    k = kvbm(sched)
    text = tokens(3 * BLOCK, base=965)
    store_and_finish(sched, text)
    assert sched.reset_prefix_cache()
    session = make_request(text + tokens(BLOCK // 2, base=966))
    assert lookup(k, session)[0] == 3 * BLOCK  # the text chunk is served
    session.mm_features.append(image("image-a", len(session.all_token_ids))[0])
    return k, session


def test_a_session_that_adds_an_image_goes_on_under_keys_that_name_it():
    k, session = _session_adds_an_image("sha256")
    assert lookup(k, session)[0] == 3 * BLOCK  # the text before the image is still its own
    state = k._reqs[session.request_id]
    assert not state.no_store and state.params.loads and state.params.stores


def test_a_session_that_adds_an_image_stops_under_keys_of_token_ids_only():
    k, session = _session_adds_an_image("xxhash")
    assert lookup(k, session)[0] == 0
    state = k._reqs[session.request_id]
    assert state.no_store and not state.params.loads and not state.params.stores
