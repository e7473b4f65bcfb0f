"""The tiers below host RAM: the page format, the disk store and the remote store."""
