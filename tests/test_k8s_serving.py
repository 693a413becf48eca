"""`hfleet k8s render-serving`: KServe InferenceServices for a registry alias whose exports live in a real
S3 store (SeaweedFS), the rollout mapped to canaryTrafficPercent (Serverless) and spec.canary (Standard),
each rendered object validated against KServe's CRD and the Kubernetes schemas."""

from __future__ import annotations

import sys

import kubernetes_validate
import pytest
import yaml

from hybridfleet.cli.app import main as cli_main
from hybridfleet.registry import Registry
from hybridfleet.serve.export import export_version
from tests.kserve_schemas import validate
from tests.serve_models import DIGITS_FACTORY, trained_digits

pytest_plugins = ["tests.seaweed"]
pytestmark = pytest.mark.torch
K8S_VERSION = "1.30.0"


@pytest.fixture(scope="module")
def s3_registry(seaweed, tmp_path_factory):
    """digits v1, v2 exported (ONNX) into an s3:// artifact store; prod -> v1."""
    import os

    env = {"AWS_ENDPOINT_URL": seaweed.endpoint_url, "AWS_ACCESS_KEY_ID": seaweed.key, "AWS_SECRET_ACCESS_KEY": seaweed.secret}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    root = tmp_path_factory.mktemp("kserve")
    reg = Registry(f"sqlite:///{root}/registry.db", store=seaweed.url("kserve-registry"))
    for seed in (0, 1):
        info = reg.register("digits", trained_digits(root / f"run-{seed}", "torch", seed=seed))
        export_version(reg, f"digits@{info.version}", "onnx", root / f"export-{info.version}", f"{DIGITS_FACTORY}:build_torch")
    reg.move_alias("digits", "prod", 1)
    yield reg
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def render(reg: Registry, capsys, *args: str) -> list[dict]:
    with pytest.raises(SystemExit) as done:
        cli_main(["k8s", "render-serving", "digits@prod", "-r", reg.db_url, "--s3-endpoint", "http://minio.storage:9000", *args])
        sys.exit(0)
    out = capsys.readouterr()
    assert done.value.code == 0, out.err
    objects = list(yaml.safe_load_all(out.out))
    for obj in objects:
        if obj["kind"] == "InferenceService":
            validate(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return objects


def isvc_of(objects: list[dict]) -> dict:
    (isvc,) = [o for o in objects if o["kind"] == "InferenceService"]
    return isvc


def test_serverless_follows_the_rollout_canary_promote_and_rollback(s3_registry, capsys):
    reg = s3_registry
    uri = {v: reg.get_version(f"digits@{v}").tags["export.onnx.uri"] for v in (1, 2)}
    # stable only
    objects = render(reg, capsys)
    predictor = isvc_of(objects)["spec"]["predictor"]
    assert predictor["model"]["storageUri"] == uri[1] and uri[1].startswith("s3://")
    assert predictor["model"]["modelFormat"] == {"name": "onnx", "version": "1"} and predictor["model"]["protocolVersion"] == "v2"
    assert "canaryTrafficPercent" not in predictor
    account, secret = objects[0], objects[1]
    assert predictor["serviceAccountName"] == account["metadata"]["name"] and account["secrets"] == [{"name": secret["metadata"]["name"]}]
    assert secret["metadata"]["annotations"] == {"serving.kserve.io/s3-endpoint": "minio.storage:9000", "serving.kserve.io/s3-usehttps": "0"}
    assert set(secret["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    # canary at 10 %
    reg.rollout("digits", "prod", canary=2, weight=10)
    predictor = isvc_of(render(reg, capsys))["spec"]["predictor"]
    assert predictor["canaryTrafficPercent"] == 10 and predictor["model"]["storageUri"] == uri[2]
    # rollback: the canary's revision at 0 %, all traffic on the previous (stable) revision
    reg.rollout("digits", "prod", rollback=True)
    predictor = isvc_of(render(reg, capsys))["spec"]["predictor"]
    assert predictor["canaryTrafficPercent"] == 0 and predictor["model"]["storageUri"] == uri[2]
    # a new canary, then promotion: the field is removed and v2 takes 100 %
    reg.rollout("digits", "prod", canary=2, weight=40)
    assert isvc_of(render(reg, capsys))["spec"]["predictor"]["canaryTrafficPercent"] == 40
    reg.rollout("digits", "prod", promote=True)
    predictor = isvc_of(render(reg, capsys))["spec"]["predictor"]
    assert "canaryTrafficPercent" not in predictor and predictor["model"]["storageUri"] == uri[2]
    reg.move_alias("digits", "prod", 1)  # back to the module's starting state


def test_standard_mode_renders_spec_canary_and_states_the_gateway_api_requirement(s3_registry, capsys):
    reg = s3_registry
    reg.rollout("digits", "prod", canary=2, weight=25)
    try:
        objects = render(reg, capsys, "--mode", "standard", "--secret-name", "team-s3")
        isvc = isvc_of(objects)
        assert [o["kind"] for o in objects] == ["ServiceAccount", "InferenceService"]  # an existing Secret: none rendered
        assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"
        assert isvc["spec"]["predictor"]["name"] == "v1"
        (canary,) = isvc["spec"]["canary"]
        assert canary["trafficPercent"] == 25 and canary["predictor"]["name"] == "v2"
        assert canary["predictor"]["model"]["storageUri"] == reg.get_version("digits@2").tags["export.onnx.uri"]
        assert "enableGatewayApi: true" in isvc["metadata"]["annotations"]["hybridfleet.io/traffic-split"]
        reg.rollout("digits", "prod", promote=True)
        isvc = isvc_of(render(reg, capsys, "--mode", "standard"))
        assert isvc["spec"]["predictor"]["name"] == "v2" and "canary" not in isvc["spec"]  # KServe's promotion
    finally:
        reg.move_alias("digits", "prod", 1)


def test_render_serving_refuses_what_kserve_cannot_serve(s3_registry, tmp_path, capsys):
    reg = s3_registry
    for args, text in ((["--format", "torch-export"], "no installed runtime serves torch.export"),
                       (["--mode", "raw"], "--mode must be one of serverless, standard"),
                       (["--format", "paddle-inference"], "has no verified paddle-inference export")):  # fmt: skip
        with pytest.raises(SystemExit) as done:
            cli_main(["k8s", "render-serving", "digits@prod", "-r", reg.db_url, *args])
        assert done.value.code == 2 and text in capsys.readouterr().err
    local = Registry(f"sqlite:///{tmp_path}/local.db")
    info = local.register("digits", trained_digits(tmp_path / "run", "torch"))
    export_version(local, f"digits@{info.version}", "onnx", tmp_path / "exp", f"{DIGITS_FACTORY}:build_torch")
    local.move_alias("digits", "prod", 1)
    with pytest.raises(SystemExit) as done:
        cli_main(["k8s", "render-serving", "digits@prod", "-r", local.db_url])
    assert done.value.code == 2 and "KServe's storage initializer reads an object store" in capsys.readouterr().err
