"""The remote tier on an LMCache server, lm:// (store.py, worker side; view.py and protocol.py, scheduler side)."""
