"""vllm_kvbm: a KV Block Manager for vLLM (the connector is vllm_kvbm.connector.KVBMConnector)."""

from importlib.metadata import PackageNotFoundError, version as _dist_version

try:
    __version__ = _dist_version("vllm-kvbm")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
