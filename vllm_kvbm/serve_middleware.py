"""`vllm serve` middleware: a request whose ``kv_transfer_params`` KVBM
cannot honour gets a 400 naming the field and the fix, before it reaches
the engine.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVBMConnector", ...}' \\
        --middleware vllm_kvbm.serve_middleware.check_kv_transfer_params

vLLM has no hook through which a connector refuses a request's params up
front; without this middleware such a request is served without KVBM
(request_params.py), and its response's ``kv_transfer_params`` says why.
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse

from vllm_kvbm.scheduler.request_params import RequestParamsError, parse


async def check_kv_transfer_params(request: Request, call_next):
    if request.method == "POST" and "json" in request.headers.get("content-type", ""):
        body = await request.body()  # Starlette hands it on to the endpoint
        if b"kv_transfer_params" in body:
            error = _refused(body)
            if error is not None:
                # the shape of vLLM's own ErrorResponse
                return JSONResponse(
                    status_code=400,
                    content={
                        "error": {
                            "message": error,
                            "type": "BadRequestError",
                            "param": "kv_transfer_params",
                            "code": 400,
                        }
                    },
                )
    return await call_next(request)


def _refused(body: bytes) -> str | None:
    try:
        payload = json.loads(body)
    except ValueError:
        return None  # vLLM answers a body it cannot read itself
    if not isinstance(payload, dict) or payload.get("kv_transfer_params") is None:
        return None
    try:
        parse(payload["kv_transfer_params"])
    except RequestParamsError as err:
        return str(err)
    return None
