"""LMBenchmark-style load generation against any OpenAI-compatible endpoint.

``client``: the synthetic multi-round QA and long document QA workloads, sent
through the openai client (streaming, so TTFT is measured at the first token);
per-request CSV plus a summary. ``compare``: one invocation that runs the same
workload against several servers, started in turn or given by URL, and writes
a Markdown report and PNG plots. ``cli``: the options. Console entry point:
``kvbm-bench``.
"""
