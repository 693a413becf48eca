"""A KServe InferenceService for a registry alias: storageUri at the verified export, canary = the rollout.

Runtimes (KServe's installed ServingRuntimes): an ONNX export is a Triton model
repository served by ``kserve-tritonserver``, which takes ``onnx`` only with
``protocolVersion: v2``; a Paddle Inference export goes to ``kserve-paddleserver``
(``paddle`` version 2). No installed runtime serves a torch.export program.

Gray release, by deployment mode:

- Serverless (Knative): one predictor; during a canary ``storageUri`` is the canary's and
  ``canaryTrafficPercent`` is the weight, so KServe keeps the previously rolled-out revision
  (the stable version) for the rest. Promotion removes the field (the latest revision gets
  100 %); a rollback renders the canary's URI with ``canaryTrafficPercent: 0``, which sends
  all traffic back to the previous revision, as KServe documents.
- Standard (ex-RawDeployment): the stable predictor is named ``v<stable>`` and the canary is
  a ``spec.canary`` entry ``v<canary>`` with ``trafficPercent``; promotion renames the
  predictor to the canary's name and drops the entry, rollback drops the entry. KServe
  splits that traffic only through the Gateway API (``ingress.enableGatewayApi: true``);
  with a plain Ingress the canary gets no traffic.

Storage: the artefact must be in an object store (``s3://``); the predictor's
ServiceAccount lists a Secret carrying the S3 endpoint annotations KServe's storage
initializer reads.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlparse

from hybridfleet.errors import UsageError
from hybridfleet.registry.refs import parse_ref
from hybridfleet.serve.export import TAG_PREFIX
from hybridfleet.serve.routing import alias_state

MODES = ("serverless", "standard")
RUNTIMES = {"onnx": ({"name": "onnx", "version": "1"}, "kserve-tritonserver"),
            "paddle-inference": ({"name": "paddle", "version": "2"}, "kserve-paddleserver")}  # fmt: skip
GATEWAY_NOTE = ("Standard mode splits traffic between the predictor and spec.canary only through the Gateway API: "
                "set ingress.enableGatewayApi: true in KServe's inferenceservice-config (a plain Ingress sends the "
                "canary no traffic)")  # fmt: skip
_DNS = re.compile(r"[^a-z0-9-]+")


def _dns_name(text: str) -> str:
    name = _DNS.sub("-", text.lower()).strip("-")[:53].strip("-")
    if not name:
        raise UsageError(f"{text!r} gives no valid Kubernetes name; pass --name")
    return name


def _storage_uri(reg: Any, full_name: str, version: int, fmt: str) -> str:
    info = reg.get_version(f"{full_name}@{version}")
    uri = info.tags.get(f"{TAG_PREFIX}.{fmt}.uri")
    if not uri:
        raise UsageError(f"{full_name} v{version} has no verified {fmt} export; run "
                         f"`hfleet registry export {full_name}@{version} --format {fmt} --model ... -o DIR` first")  # fmt: skip
    if urlparse(uri).scheme != "s3":
        raise UsageError(f"{full_name} v{version}'s {fmt} export is at {uri}; KServe's storage initializer reads an object "
                         f"store: use a registry whose artifact store is s3:// (`hfleet registry init --store s3://...`)")  # fmt: skip
    return uri


def render_inference_service(reg: Any, ref: str, mode: str = "serverless", fmt: str = "onnx", namespace: str = "default",
                             name: str | None = None, s3_endpoint: str | None = None, s3_region: str | None = None,
                             secret_name: str | None = None, cpu: str = "1", memory: str = "2Gi") -> list[dict[str, Any]]:  # fmt: skip
    """[ServiceAccount, (Secret), InferenceService] serving ``ref`` (NAME@ALIAS) as the registry's rollout says.

    ``secret_name`` names an existing Secret with the S3 keys (then none is rendered);
    otherwise a Secret with REPLACE-with-... key values and the endpoint annotations is
    rendered. UsageError for a mode, format or version KServe cannot serve.
    """
    if mode not in MODES:
        raise UsageError(f"--mode must be one of {', '.join(MODES)} (got {mode!r})")
    if fmt not in RUNTIMES:
        raise UsageError(f"--format {fmt}: KServe serves onnx (Triton) and paddle-inference (paddle server); "
                         f"no installed runtime serves torch.export programs")  # fmt: skip
    parsed = parse_ref(ref)
    if parsed.alias is None:
        raise UsageError(f"{ref}: render-serving follows an alias (NAME@ALIAS), whose rollout becomes the canary")
    stable, canary, weight, _ = alias_state(reg, parsed.full_name, parsed.alias)
    events = reg.history(parsed.full_name, parsed.alias)
    rolled_back = events[-1]["action"] == "rollback" and len(events) > 1 and events[-2]["canary_version"] is not None
    isvc_name = _dns_name(name or f"{parsed.name}-{parsed.alias}")
    account = f"{isvc_name}-storage"
    secret = secret_name or f"{isvc_name}-s3"
    model_format, runtime = RUNTIMES[fmt]

    def model(version: int) -> dict[str, Any]:
        # `model` inlines a container; a canary's predictor model must name it (KServe's container name)
        return {"name": "kserve-container", "modelFormat": dict(model_format), "runtime": runtime, "protocolVersion": "v2",
                "storageUri": _storage_uri(reg, parsed.full_name, version, fmt),
                "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": {"cpu": cpu, "memory": memory}}}  # fmt: skip

    labels = {"app.kubernetes.io/managed-by": "hybridfleet", "hybridfleet.io/model": parsed.name,
              "hybridfleet.io/alias": parsed.alias}  # fmt: skip
    annotations = {"serving.kserve.io/deploymentMode": "Knative" if mode == "serverless" else "Standard",
                   "hybridfleet.io/registry-version": str(stable)}  # fmt: skip
    if mode == "serverless":
        if canary is not None:
            predictor = {"serviceAccountName": account, "canaryTrafficPercent": _percent(weight), "model": model(canary)}
            annotations["hybridfleet.io/canary-version"] = str(canary)
        elif rolled_back:
            dropped = events[-2]["canary_version"]
            predictor = {"serviceAccountName": account, "canaryTrafficPercent": 0, "model": model(dropped)}
            annotations["hybridfleet.io/rolled-back-version"] = str(dropped)
        else:
            predictor = {"serviceAccountName": account, "model": model(stable)}
        spec: dict[str, Any] = {"predictor": predictor}
    else:
        spec = {"predictor": {"name": f"v{stable}", "serviceAccountName": account, "model": model(stable)}}
        if canary is not None:
            spec["canary"] = [{"predictor": {"name": f"v{canary}", "serviceAccountName": account, "model": model(canary)},
                               "trafficPercent": _percent(weight)}]  # fmt: skip
            annotations["hybridfleet.io/canary-version"] = str(canary)
        annotations["hybridfleet.io/traffic-split"] = GATEWAY_NOTE
    objects: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "ServiceAccount",
                                      "metadata": {"name": account, "namespace": namespace, "labels": labels},
                                      "secrets": [{"name": secret}]}]  # fmt: skip
    if secret_name is None:
        s3_annotations = {}
        if s3_endpoint:
            endpoint = urlparse(s3_endpoint if "://" in s3_endpoint else f"https://{s3_endpoint}")
            s3_annotations["serving.kserve.io/s3-endpoint"] = endpoint.netloc
            s3_annotations["serving.kserve.io/s3-usehttps"] = "1" if endpoint.scheme == "https" else "0"
        if s3_region:
            s3_annotations["serving.kserve.io/s3-region"] = s3_region
        objects.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                        "metadata": {"name": secret, "namespace": namespace, "labels": labels, "annotations": s3_annotations},
                        "stringData": {"AWS_ACCESS_KEY_ID": "REPLACE-with-the-access-key-id",
                                       "AWS_SECRET_ACCESS_KEY": "REPLACE-with-the-secret-access-key"}})  # fmt: skip
    objects.append({"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
                    "metadata": {"name": isvc_name, "namespace": namespace, "labels": labels, "annotations": annotations},
                    "spec": spec})  # fmt: skip
    return objects


def _percent(weight: float) -> int:
    """KServe takes whole percents; the registry's weight is rounded (0 < w < 1 stays 1, never 0)."""
    rounded = int(round(weight))
    return 1 if 0 < weight and rounded == 0 else min(rounded, 100)
