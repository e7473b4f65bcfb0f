"""Tools around the connector: the demo, the local model builder and the
``vllm serve`` helper used by the demo, the benchmarks and the tests."""
