"""The shared page pool tier: pool files in memory (layout, pool_file, store, view, attach)."""
