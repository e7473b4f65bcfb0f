"""What runs in each vLLM worker process: the host pool, the NIXL page mover,
transfer completions and the lower tiers' I/O threads."""
