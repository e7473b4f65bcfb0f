"""A KVBMConnector that writes config_identity() as each process sees it
(the scheduler and every worker) to $KVBM_IDENTITY_PROBE_DIR: the two sides
of one engine must agree, or they would name pages differently."""

from __future__ import annotations

import json
import os

from vllm_kvbm.connector import KVBMConnector
from vllm_kvbm.identity_fields import config_identity, identity_env


class IdentityProbeConnector(KVBMConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        out = os.environ["KVBM_IDENTITY_PROBE_DIR"]
        path = os.path.join(out, f"{role.name.lower()}-{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(
                {"config": config_identity(vllm_config), "env": identity_env()}, f, sort_keys=True
            )
