"""The tiers below host RAM: one folder per medium (disk/, lm/, redis/), each with its
worker-side store and scheduler-side view; the interfaces (base.py), the registry, the
reconnect policy and the page format they share."""
