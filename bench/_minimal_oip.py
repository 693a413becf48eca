"""The anchor of bench/serve.py: the least server that answers an OIP v2 JSON infer request.

    python bench/_minimal_oip.py MODEL.onnx PORT [MODEL_NAME] [orjson|json]

uvicorn + one onnxruntime session; no routing, no auth, no metrics, no input checks.
Bodies are read and written with orjson, as `hfleet serve` does (the fair anchor), or with
the standard library's json (``json``: what a plainer server would use).
"""

import json
import sys

import numpy as np
import onnxruntime as ort
import orjson
import uvicorn

options = ort.SessionOptions()
options.intra_op_num_threads = 1
options.inter_op_num_threads = 1
MODEL_NAME = sys.argv[3] if len(sys.argv) > 3 else "digits"
JSON = sys.argv[4] if len(sys.argv) > 4 else "orjson"
loads, dumps = (orjson.loads, orjson.dumps) if JSON == "orjson" else (json.loads, lambda doc: json.dumps(doc).encode())
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"].endswith("/ready"):
        payload = b'{"ready": true}'
    else:
        tensor = loads(body)["inputs"][0]
        x = np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"])
        y = session.run(None, {"input": x})[0]
        payload = dumps({"model_name": MODEL_NAME, "outputs": [{"name": "output", "datatype": "FP32",
                         "shape": list(y.shape), "data": y.reshape(-1).tolist()}]})
    # a Content-Length, as hfleet serve sends: without one h11 frames the response as chunked
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
