"""What runs in vLLM's scheduler process: request tracking and planning, the
host slot index, the lower-tier policy and lookups. No KV bytes, no LMCache."""
