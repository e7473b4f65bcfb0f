"""Demo: a returning long prompt is served from KVBM's host tier.

Starts ``vllm serve`` with KVBMConnector and an engine KV cache too small to
keep two long documents, then sends document A, document B (which pushes A
out of the engine's own prefix cache) and document A again. The third
request finds A's blocks in the host tier, onboards them through NIXL and
skips their prefill; the demo prints both TTFTs and the KVBM counters.

    python -m vllm_kvbm.tools.demo                  # the local model, built if missing
    python -m vllm_kvbm.tools.demo --model PATH     # any Hugging Face model directory
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

from vllm_kvbm.bench.cores import fair_cpu_env, process_binding
from vllm_kvbm.tools.compute_dtype import compute_dtype, describe
from vllm_kvbm.tools.server import kvbm_transfer_config, vllm_server


def document(tokenizer, num_tokens: int, source: str) -> str:
    """About ``num_tokens`` tokens of real text: a stdlib module's source."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / source).read_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:num_tokens]
    return tokenizer.decode(ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: local model)")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument(
        "--engine-kv-blocks",
        type=int,
        default=28,
        help="engine KV cache size in blocks (too small for two prompts)",
    )
    parser.add_argument("--host-cache-size", default="1GiB")
    args = parser.parse_args(argv)

    if args.model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        print("Building the local model (once) ...", flush=True)
        args.model = str(build(DEFAULT_DIR))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    doc_a = document(tokenizer, args.prompt_tokens, "typing.py")
    doc_b = document(tokenizer, args.prompt_tokens, "inspect.py")
    # A third document as long as the others: the first long prefill pays
    # one-off costs (allocations, kernel selection) that are not prefill time.
    doc_warm = document(tokenizer, args.prompt_tokens, "difflib.py")
    dtype = compute_dtype()
    print(f"dtype: {describe()}", flush=True)
    block_size = 128
    serve_args = [
        "--block-size",
        str(block_size),
        "--num-gpu-blocks-override",
        str(args.engine_kv_blocks),
        # One block is vLLM's reserved null block.
        "--max-model-len",
        str((args.engine_kv_blocks - 1) * block_size),
        "--max-num-batched-tokens",
        str((args.engine_kv_blocks - 1) * block_size),
        "--gpu-memory-utilization",
        "0.3",
        "--enforce-eager",
        "--dtype",
        dtype,
    ]
    kv_config = kvbm_transfer_config(host_cache_size=args.host_cache_size)
    print(f"Starting vllm serve {args.model} with KVBMConnector ...", flush=True)
    # The binding vLLM gives a plain engine (unless yours is set): KVBM needs no
    # core of its own, though vLLM reserves one more for any KV connector.
    cpu_env = fair_cpu_env()
    with vllm_server(args.model, kv_config, serve_args, env=cpu_env) as server:
        server.stream_completion(doc_warm, max_tokens=2)
        ttft_miss, _, _ = server.stream_completion(doc_a)
        server.stream_completion(doc_b)  # evicts A from the engine's prefix cache
        local_hits_before = server.metric("vllm:prefix_cache_hits_total")
        ttft_hit, _, _ = server.stream_completion(doc_a)
        local_hits = server.metric("vllm:prefix_cache_hits_total") - local_hits_before
        offloaded = server.metric("kvbm_offload_blocks_total")
        onboarded = server.metric("kvbm_onboard_blocks_total")
        matched = server.metric("kvbm_matched_tokens_total")
        binding = process_binding(server.process.pid)  # its OpenMP cores, read while it runs

    print()
    print(
        f"prompt: ~{args.prompt_tokens} tokens; engine KV cache: "
        f"{args.engine_kv_blocks} blocks of {block_size} tokens; dtype {dtype}; "
        f"engine on {binding.describe() if binding else 'an unreported binding'} "
        f"({' '.join(f'{k}={v}' for k, v in cpu_env.items())}: a plain engine's binding)"
    )
    print(f"TTFT, first request (miss, full prefill):   {ttft_miss * 1000:8.0f} ms")
    print(f"TTFT, returning request (KVBM host hit):    {ttft_hit * 1000:8.0f} ms")
    print(f"speedup: {ttft_miss / ttft_hit:.1f}x")
    print(
        f"blocks offloaded to host: {offloaded:.0f}; onboarded from host: "
        f"{onboarded:.0f}; tokens matched in KVBM: {matched:.0f}; "
        f"tokens still in the engine's own cache: {local_hits:.0f}"
    )
    if onboarded <= 0:
        print("ERROR: the returning request did not onboard any block", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
