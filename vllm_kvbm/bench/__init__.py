"""LMBenchmark-style load generation against any OpenAI-compatible endpoint.

``client``: the synthetic multi-round QA and long document QA workloads, driven
over async HTTP (aiohttp, streaming, so TTFT is measured at the first token);
per-request CSV plus a summary. ``compare``: one invocation that starts and
stops each server configuration in turn on the same model and workload and
writes a Markdown table and PNG plots. Console entry point: ``kvbm-bench``.
"""
