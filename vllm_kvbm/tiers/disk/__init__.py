"""The disk tier: page files in a directory (store.py, worker side; view.py, scheduler side)."""
