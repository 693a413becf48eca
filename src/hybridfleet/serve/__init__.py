"""Serving: verified export of a registered model and an Open Inference Protocol v2 server.

`export` loads a version's weights into the job's own model code and writes an artefact
(ONNX, torch.export, Paddle Inference) only after its runtime reproduced the framework
model's outputs; `server` answers OIP v2 requests, routed by the registry's rollout.
Neither torch, paddle nor onnxruntime is imported until a function needs it.
"""
