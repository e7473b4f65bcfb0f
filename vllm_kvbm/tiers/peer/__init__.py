"""Reading other machines' pools (store.py) and serving this one's (server.py) through NIXL."""
