"""Offline use: vllm.LLM with KVBMConnector; the second generate onboards the prefix.

.venv/bin/python examples/offline_llm.py [MODEL]
"""

import sys
import time

from vllm import LLM, SamplingParams

from vllm_kvbm.tools.server import kvbm_transfer_config

if __name__ == "__main__":  # vLLM on CPU spawns processes: keep the guard
    model = sys.argv[1] if len(sys.argv) > 1 else "models/kvbm-llama-8l"
    llm = LLM(
        model,
        enforce_eager=True,
        max_model_len=8192,
        kv_transfer_config=kvbm_transfer_config(host_cache_size="2GiB"),
    )
    prompt = {"prompt_token_ids": list(range(100, 100 + 4000))}
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for label in ("miss", "host hit"):
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        print(
            f"{label}: {time.perf_counter() - start:.2f}s, "
            f"{out.num_cached_tokens} prompt tokens not recomputed, "
            f"output {list(out.outputs[0].token_ids)}"
        )
        llm.reset_prefix_cache()  # drop vLLM's own copy; KVBM's host tier keeps it
