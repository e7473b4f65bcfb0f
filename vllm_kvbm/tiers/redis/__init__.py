"""The remote tier on Redis/Valkey (store.py, worker side; view.py and connection.py, scheduler side)."""
