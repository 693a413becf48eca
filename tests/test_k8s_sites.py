"""`hfleet k8s render` for PS jobs: per-site credentials, security variants, the hybrid topology, plain hosts.

Every pod's command is parsed by the real `hfleet` CLI, and its security is built from
exactly the files of the Secret the pod mounts (shards: `ps.serve.server_security`;
workers: the worker CLI's certificate lookup and a token checked by the shards' key).
No cluster runs here: scheduling, image pulls and DNS are a real cluster's part.
"""

from __future__ import annotations

import copy
import re
import stat
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import typer.main
import yaml

from hybridfleet.cli.app import main
from hybridfleet.errors import AuthError, SpecError
from hybridfleet.k8s.common import CERTS_DIR, JOB_FILE, RenderOptions
from hybridfleet.k8s.credentials import CredentialSource
from hybridfleet.k8s.render import render_job_file
from hybridfleet.security.certs import make_dev_pki
from hybridfleet.security.tokens import TokenVerifier, generate_signing_key
from hybridfleet.spec.load import parse_spec

K8S_VERSION = "1.30.0"
EXTERNAL = ("ps0.example.org", "ps1.example.org")
HOSPITAL_NET = ("203.0.113.0/24",)  # where the hospital's workers connect from
INTERNAL = ("digits-hybrid-ps-0.digits-hybrid-ps", "digits-hybrid-ps-1.digits-hybrid-ps")
JOB = {
    "name": "digits-hybrid", "framework": "torch", "entrypoint": "examples/digits/train_torch.py", "mode": "ps",
    "sites": {"hospital": {"workers": 2}, "cloud": {"workers": 1}},
    "ps": {"shards": 2},
    "environment": {"image": "registry.example.com/hfleet/digits:1.0"},
}
VARIANTS = {
    "default": {},
    "tls-off": {"tls": "off"},
    "tokens-off": {"tokens": "off"},
    "both-off": {"tls": "off", "tokens": "off"},
    "mutual-tls": {"mutual_tls": True},
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pki")
    make_dev_pki(directory, hosts=[*INTERNAL, *EXTERNAL], clients=["hospital", "cloud"])
    generate_signing_key(directory)
    return directory


def _job(tmp_path: Path, **security) -> Path:
    job = copy.deepcopy(JOB)
    if security:
        job["security"] = security
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _pods(manifests: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, pod spec) of every StatefulSet and Job."""
    return [(m, m["spec"]["template"]["spec"]) for m in manifests if m["kind"] in ("StatefulSet", "Job")]


def _mounted_secret(manifests: list[dict], pod: dict) -> dict[str, str]:
    names = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
    secrets = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Secret"}
    return {k: v for name in names for k, v in secrets[name]["stringData"].items()}


def _materialise(files: dict[str, str], directory: Path) -> Path:
    """The Secret as the kubelet mounts it: one file per key."""
    directory.mkdir(parents=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


def _parse(command: list[str], job: Path, certs_dir: Path, env: dict[str, str]):
    """Parse a container command with the real CLI (after $(VAR) expansion); return (command name, params)."""
    from hybridfleet.cli.app import app

    args = []
    for arg in command[1:]:
        for var, value in env.items():
            arg = arg.replace(f"$({var})", value)
        args.append(str(job) if arg == JOB_FILE else str(certs_dir) if arg == CERTS_DIR else arg)
    assert "$(" not in " ".join(args), args
    cli = typer.main.get_command(app)
    ctx = cli.make_context("hfleet", list(args))
    cmd, rest = cli.get_command(ctx, args[0]), args[1:]
    name = args[0]
    if hasattr(cmd, "get_command"):
        name, cmd, rest = f"{args[0]} {rest[0]}", cmd.get_command(ctx, rest[0]), rest[1:]
    return name, cmd.make_context(name, rest).params


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_security_variant_renders_pods_whose_commands_parse_and_whose_mounted_secret_suffices(
        tmp_path, certs, variant):
    """Shards start their TLS/token checks from their Secret alone; workers get TLS + a token the shards accept."""
    from hybridfleet.cli.worker import _client_tls_files
    from hybridfleet.ps.server.serve import server_security
    from hybridfleet.ps.worker.session import client_security_from_env

    # Prepare
    job = _job(tmp_path, **VARIANTS[variant])
    spec = parse_spec(yaml.safe_load(job.read_text()), str(job))

    # Execute
    manifests = render_job_file(job, RenderOptions(credentials=CredentialSource(certs)))

    # Assert
    shard_dir = None
    parsed = []
    for index, (workload, pod) in enumerate(_pods(manifests)):
        kubernetes_validate.validate(workload, K8S_VERSION, strict=True)
        files = _mounted_secret(manifests, pod)
        directory = _materialise(files, tmp_path / f"pod-{index}")
        (container,) = pod["containers"]
        name, params = _parse(container["command"], job, directory, {"HFLEET_SHARD": "1"})
        parsed.append(name)
        if name == "ps serve":
            assert params["expected_workers"] == 3
            security = server_security(spec, params["certs"], params["insecure_plaintext"], params["no_auth"])
            assert security.insecure == (spec.security.tls == "off")
            assert (security.verifier is None) == (spec.security.tokens == "off")
            shard_dir = directory
        else:
            assert "server.key" not in files and "ca.key" not in files and "token-signing.key" not in files
            site, wid = params["site"], f"{params['site']}-{params['site_rank']}"
            tokens = {k: v for k, v in files.items() if k.startswith("worker-token-")}
            assert set(tokens) == ({f"worker-token-{wid}"} if spec.security.tokens != "off" else set())
            token = tokens.get(f"worker-token-{wid}")  # the pod's Secret holds its own worker's token alone
            env = {"HFLEET_TOKEN": token} if token else {}
            if params["insecure_plaintext"]:
                env["HFLEET_INSECURE"] = "1"
            else:
                env.update(_client_tls_files(params["certs"], site, spec.security.mutual_tls))
                assert Path(env["HFLEET_CA_CERT"]).read_text() == (certs / "ca.pem").read_text()
                if spec.security.mutual_tls:
                    assert env["HFLEET_CLIENT_CERT"].endswith(f"client-{site}.pem")
                    assert {k for k in files if k.startswith("client-")} == {f"client-{site}.pem", f"client-{site}.key"}
            security = client_security_from_env(env)
            assert security.insecure == (spec.security.tls == "off")
            if spec.security.tokens != "off":
                claims = TokenVerifier.from_dir(shard_dir, job=spec.name).verify(token, roles=["worker"])
                assert claims.site == site and claims.worker == wid
    assert parsed == ["ps serve", "worker", "worker", "worker"]  # one pod per worker: hospital 0 and 1, cloud 0


def test_each_worker_pod_mounts_a_secret_holding_only_its_own_token(tmp_path, certs):
    # Execute
    manifests = render_job_file(_job(tmp_path, mutual_tls=True), RenderOptions(credentials=CredentialSource(certs)))

    # Assert: every worker's pod mounts exactly one Secret, which names that worker alone
    jobs = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Job"}
    assert sorted(jobs) == ["digits-hybrid-worker-cloud-0", "digits-hybrid-worker-hospital-0",
                            "digits-hybrid-worker-hospital-1"]
    secrets = {m["metadata"]["name"]: m["stringData"] for m in manifests if m["kind"] == "Secret"}
    tokens = []
    for name, job in jobs.items():
        pod = job["spec"]["template"]["spec"]
        site, rank = job["metadata"]["labels"]["hybridfleet/site"], job["metadata"]["labels"]["hybridfleet/site-rank"]
        mounted = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
        assert mounted == [f"digits-hybrid-creds-{site}-{rank}"]
        files = secrets[mounted[0]]
        assert set(files) == {"ca.pem", f"client-{site}.pem", f"client-{site}.key", f"worker-token-{site}-{rank}"}
        token_file = [e["value"] for e in pod["containers"][0]["env"] if e["name"] == "HFLEET_TOKEN_FILE"]
        assert token_file == [f"/etc/hfleet/certs/worker-token-{site}-{rank}"]
        claims = TokenVerifier.from_dir(certs, job="digits-hybrid").verify(files[f"worker-token-{site}-{rank}"],
                                                                           roles=["worker"])
        assert (claims.site, claims.worker) == (site, f"{site}-{rank}")
        tokens.append(files[f"worker-token-{site}-{rank}"])
    assert len(set(tokens)) == 3
    assert set(secrets["digits-hybrid-creds-ps"]) == {"ca.pem", "server.pem", "server.key", "token-signing.pub"}
    assert sorted(secrets) == ["digits-hybrid-creds-cloud-0", "digits-hybrid-creds-hospital-0",
                               "digits-hybrid-creds-hospital-1", "digits-hybrid-creds-ps"]


def test_the_leader_of_an_aggregating_site_alone_holds_the_site_hub_certificate_and_verifying_key(tmp_path, certs):
    # Prepare: the hospital's two workers reduce at their leader's site hub
    job = copy.deepcopy(JOB)
    job["sites"]["hospital"]["aggregate"] = True
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    # Execute
    manifests = render_job_file(path, RenderOptions(credentials=CredentialSource(certs)))
    # Assert: the leader's Secret has the hub certificate (valid for the hub name only) and the
    # public verifying key; the follower's and the other site's have neither
    secrets = {m["metadata"]["name"]: m["stringData"] for m in manifests if m["kind"] == "Secret"}
    leader, follower = secrets["digits-hybrid-creds-hospital-0"], secrets["digits-hybrid-creds-hospital-1"]
    assert {"hub-hospital.pem", "hub-hospital.key", "token-signing.pub"} <= set(leader)
    assert not {"hub-hospital.pem", "hub-hospital.key", "token-signing.pub"} & set(follower)
    assert not any(name.startswith("hub-") for name in secrets["digits-hybrid-creds-cloud-0"])
    assert "server.key" not in leader
    from hybridfleet.security.certs import HUB_SERVER_NAME, describe_certificate

    (tmp_path / "hub.pem").write_text(leader["hub-hospital.pem"])
    assert list(describe_certificate("hub", tmp_path / "hub.pem").sans) == [HUB_SERVER_NAME]


def test_certs_without_the_service_names_are_refused_naming_them_and_nothing_is_written(tmp_path, capsys):
    # Prepare: the default PKI only has 127.0.0.1/localhost
    main(["certs", "init", str(tmp_path / "pki")])
    capsys.readouterr()

    # Execute
    with pytest.raises(SystemExit) as exit_info:
        main(["k8s", "render", str(_job(tmp_path)), "-o", str(tmp_path / "out"), "--certs", str(tmp_path / "pki")])

    # Assert
    err = capsys.readouterr().err
    assert exit_info.value.code == 9
    assert f"lacks the names workers dial: {INTERNAL[0]}, {INTERNAL[1]}" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_mutual_tls_without_a_site_client_certificate_is_refused(tmp_path):
    pki = tmp_path / "pki"
    make_dev_pki(pki, hosts=list(INTERNAL), clients=["cloud"])
    generate_signing_key(pki)
    with pytest.raises(AuthError, match=r"missing client-hospital.pem, needed by the hospital Secret.*--client hospital"):
        render_job_file(_job(tmp_path, mutual_tls=True), RenderOptions(credentials=CredentialSource(pki)))


def test_cloud_site_bundle_exposes_each_shard_outside_on_both_ports(tmp_path, certs):
    # Execute
    manifests = render_job_file(_job(tmp_path), RenderOptions(site="cloud", external_names=EXTERNAL,
                                                              ingress_cidrs=HOSPITAL_NET,
                                                              credentials=CredentialSource(certs)))

    # Assert
    for manifest in manifests:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    external = [m for m in manifests if m["kind"] == "Service" and m["spec"].get("type") == "LoadBalancer"]
    assert [s["spec"]["selector"] for s in external] == [
        {"statefulset.kubernetes.io/pod-name": "digits-hybrid-ps-0"},
        {"statefulset.kubernetes.io/pod-name": "digits-hybrid-ps-1"}]
    assert [[p["port"] for p in s["spec"]["ports"]] for s in external] == [[50051, 50052]] * 2
    assert [s["metadata"]["annotations"]["external-dns.alpha.kubernetes.io/hostname"] for s in external] == list(EXTERNAL)
    jobs = [m for m in manifests if m["kind"] == "Job"]
    assert [j["metadata"]["name"] for j in jobs] == ["digits-hybrid-worker-cloud-0"]
    command = jobs[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--servers") + 1] == ",".join(f"{h}:50051" for h in INTERNAL)
    secrets = sorted(m["metadata"]["name"] for m in manifests if m["kind"] == "Secret")
    assert secrets == ["digits-hybrid-creds-cloud-0", "digits-hybrid-creds-ps"]
    assert all(s["spec"]["externalTrafficPolicy"] == "Local" for s in external)  # the client's address stays


def test_hospital_bundle_holds_only_its_credentials_and_dials_the_external_names(tmp_path, certs):
    manifests = render_job_file(_job(tmp_path), RenderOptions(site="hospital", external_names=EXTERNAL,
                                                              credentials=CredentialSource(certs)))
    assert sorted(m["kind"] for m in manifests) == ["ConfigMap", "Job", "Job", "NetworkPolicy", "NetworkPolicy",
                                                    "Secret", "Secret"]
    secrets = [m["stringData"] for m in manifests if m["kind"] == "Secret"]
    assert [set(s) for s in secrets] == [{"ca.pem", "worker-token-hospital-0"}, {"ca.pem", "worker-token-hospital-1"}]
    job = next(m for m in manifests if m["kind"] == "Job")
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--servers") + 1] == "ps0.example.org:50051,ps1.example.org:50051"


@pytest.mark.parametrize(("options", "message"), [
    (RenderOptions(site="hospital"), "--site hospital: other sites reach the shards from outside"),
    (RenderOptions(site="lab", external_names=EXTERNAL), "--site: 'lab' is not a site of the job"),
    (RenderOptions(site="cloud", external_names=EXTERNAL[:1]), "--external-name: give one per shard (2), got 1"),
    (RenderOptions(site="cloud", external_names=EXTERNAL), "--external-name: the shards' NetworkPolicy admits the "
                                                           "other sites by source address; give --ingress-cidr"),
    (RenderOptions(site="cloud", external_names=EXTERNAL, ingress_cidrs=("203.0.113.7/24",)),
     "--ingress-cidr: '203.0.113.7/24' is not a network address with a prefix length"),
    (RenderOptions(site="hospital", external_names=EXTERNAL, ingress_cidrs=HOSPITAL_NET),
     "--ingress-cidr: only the bundle that exposes the shards"),
    (RenderOptions(ingress_cidrs=HOSPITAL_NET), "--ingress-cidr: only the bundle that exposes the shards"),
    (RenderOptions(metrics_namespace="Monitoring!"), "--metrics-namespace: 'Monitoring!' is not a namespace name"),
    (RenderOptions(api="v2"), "--api v2: only collective jobs become a TrainJob"),
    (RenderOptions(scheduler="kube-batch"), "--scheduler: must be one of volcano"),
])
def test_bad_site_options_are_refused_and_nothing_is_written(tmp_path, options, message):
    from hybridfleet.k8s.render import render_to_dir

    with pytest.raises(SpecError, match=re.escape(message)):
        render_to_dir(_job(tmp_path), options, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_worker_name_longer_than_a_dns_label_is_refused_naming_the_site(tmp_path):
    job = copy.deepcopy(JOB)
    job["sites"]["a-very-long-site-name-for-the-hospital-ward"] = {"workers": 10}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    with pytest.raises(SpecError, match=r"sites\.a-very-long-site-name-for-the-hospital-ward: the worker Job name "
                                        r"'digits-hybrid-worker-a-very-long-site-name-for-the-hospital-ward-9' has 66 "
                                        r"characters, over Kubernetes' 63"):
        render_job_file(path, RenderOptions(credentials=CredentialSource(placeholders=True)))


def test_volcano_gang_puts_every_pod_in_one_pod_group(tmp_path):
    manifests = render_job_file(_job(tmp_path), RenderOptions(credentials=CredentialSource(placeholders=True),
                                                              scheduler="volcano"))
    (group,) = [m for m in manifests if m["kind"] == "PodGroup"]
    assert group["spec"]["minMember"] == 2 + 3  # shards + workers
    for _, pod in _pods(manifests):
        assert pod["schedulerName"] == "volcano"
    for workload, _ in _pods(manifests):
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["scheduling.k8s.io/group-name"] == group["metadata"]["name"]


def test_quota_example_is_valid_and_sized_for_the_job(tmp_path, capsys):
    main(["k8s", "quota", str(_job(tmp_path)), "--namespace", "team-x", "--jobs", "2"])
    out = capsys.readouterr().out
    assert "&id" not in out and "*id" not in out  # plain YAML to paste: shared values written out, no anchors
    quota, limits = yaml.safe_load_all(out)
    for manifest in (quota, limits):
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    assert quota["spec"]["hard"]["pods"] == "10"  # (2 shards + 3 workers) x 2 jobs
    assert quota["spec"]["hard"]["requests.memory"] == "20Gi"
    assert limits["spec"]["limits"][0]["default"] == {"cpu": "1", "memory": "2Gi"}


def test_plain_host_bundle_for_the_hospital_holds_its_files_and_a_runnable_worker_script(tmp_path, certs, capsys):
    # Execute
    main(["k8s", "render", str(_job(tmp_path, mutual_tls=True)), "--site", "hospital", "--plain-host",
          "--external-name", EXTERNAL[0], "--external-name", EXTERNAL[1], "--certs", str(certs),
          "-o", str(tmp_path / "bundle")])

    # Assert
    bundle = tmp_path / "bundle"
    assert sorted(p.name for p in (bundle / "certs").iterdir()) == ["ca.pem", "client-hospital.key",
                                                                      "client-hospital.pem", "worker-token-hospital-0",
                                                                      "worker-token-hospital-1"]
    assert stat.S_IMODE((bundle / "certs" / "worker-token-hospital-1").stat().st_mode) == 0o600
    assert not (bundle / "run-shard.sh").exists()
    script = (bundle / "run-worker.sh").read_text()
    assert subprocess.run(["bash", "-n", str(bundle / "run-worker.sh")]).returncode == 0
    assert "--servers ps0.example.org:50051,ps1.example.org:50051 --certs certs" in script
    assert "ExecStart=/opt/hfleet/digits-hybrid/run-worker.sh %i" in (bundle / "hfleet-worker@.service").read_text()
    # the script's worker command parses with the real CLI, from inside the bundle
    line = next(l for l in script.splitlines() if l.startswith("exec "))
    command = line.removeprefix("exec ").replace('"$1"', "1").split()
    name, params = _parse(command, bundle / "job.yaml", bundle / "certs", {})
    assert name == "worker" and params["site"] == "hospital" and params["site_rank"] == 1


def test_plain_host_bundle_of_one_worker_s_machine_holds_only_its_token_and_runs_only_its_rank(tmp_path, certs, capsys):
    # Execute
    main(["k8s", "render", str(_job(tmp_path, mutual_tls=True)), "--site", "hospital", "--plain-host", "--site-rank", "1",
          "--external-name", EXTERNAL[0], "--external-name", EXTERNAL[1], "--certs", str(certs),
          "-o", str(tmp_path / "bundle")])

    # Assert
    bundle = tmp_path / "bundle"
    assert sorted(p.name for p in (bundle / "certs").iterdir()) == ["ca.pem", "client-hospital.key",
                                                                      "client-hospital.pem", "worker-token-hospital-1"]
    refused = subprocess.run(["bash", str(bundle / "run-worker.sh"), "0"], capture_output=True, text=True)
    assert refused.returncode == 2 and "this bundle holds the token of site rank 1 only" in refused.stderr


@pytest.mark.parametrize(("extra", "message"), [
    (["--plain-host", "--site-rank", "2"], "--site-rank: must be in 0..1 for site 'hospital' (got 2)"),
    (["--site-rank", "0"], "only with --plain-host"),
])
def test_a_bad_site_rank_is_refused_and_nothing_is_written(tmp_path, certs, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["k8s", "render", str(_job(tmp_path)), "--site", "hospital", *extra, "--external-name", EXTERNAL[0],
              "--external-name", EXTERNAL[1], "--certs", str(certs), "-o", str(tmp_path / "out")])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert message in " ".join(err.split()) and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_plain_host_bundle_of_the_shard_site_has_shard_units_and_needs_certs(tmp_path, certs, capsys):
    job = _job(tmp_path)
    with pytest.raises(SystemExit):
        main(["k8s", "render", str(job), "--site", "cloud", "--plain-host", "--external-name", EXTERNAL[0],
              "--external-name", EXTERNAL[1], "-o", str(tmp_path / "nope")])
    assert "--plain-host: needs --certs DIR" in capsys.readouterr().err
    assert not (tmp_path / "nope").exists()
    main(["k8s", "render", str(job), "--site", "cloud", "--plain-host", "--external-name", EXTERNAL[0],
          "--external-name", EXTERNAL[1], "--certs", str(certs), "-o", str(tmp_path / "cloud")])
    bundle = tmp_path / "cloud"
    assert {"server.key", "token-signing.pub", "worker-token-cloud-0"} <= {p.name for p in (bundle / "certs").iterdir()}
    assert "token-signing.key" not in {p.name for p in (bundle / "certs").iterdir()}
    assert "--expected-workers 3" in (bundle / "run-shard.sh").read_text()
    assert (bundle / "hfleet-shard@.service").is_file()


def test_aggregating_site_finds_its_leader_through_a_headless_service(tmp_path, capsys, certs):
    # Prepare: the hospital reduces inside the site; one leader talks to the shards
    job = copy.deepcopy(JOB)
    job["sites"]["hospital"]["aggregate"] = True
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))

    # Execute
    manifests = render_job_file(path, RenderOptions(credentials=CredentialSource(placeholders=True)))

    # Assert
    for manifest in manifests:
        if manifest["kind"] != "Secret":
            kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    hub = [m for m in manifests if m["kind"] == "Service" and m["metadata"]["name"] == "digits-hybrid-worker-hospital"]
    assert hub and hub[0]["spec"]["clusterIP"] == "None"
    jobs = {m["metadata"]["name"]: m["spec"]["template"]["spec"] for m in manifests if m["kind"] == "Job"}
    for rank in (0, 1):  # each pod: hostname = its Job's name, subdomain = the site's headless Service
        hospital = jobs[f"digits-hybrid-worker-hospital-{rank}"]
        assert (hospital["hostname"], hospital["subdomain"]) == (f"digits-hybrid-worker-hospital-{rank}",
                                                                 "digits-hybrid-worker-hospital")
        assert {"name": "HFLEET_SITE_HUB",
                "value": "digits-hybrid-worker-hospital-0.digits-hybrid-worker-hospital:50060"} \
            in hospital["containers"][0]["env"]
    assert "subdomain" not in jobs["digits-hybrid-worker-cloud-0"]
    (shards,) = [m for m in manifests if m["kind"] == "StatefulSet"]
    command = shards["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--expected-workers") + 1] == "2"  # the hospital's leader + the cloud worker
    # on plain hosts the leader's address is the operator's to give
    main(["k8s", "render", str(path), "--site", "hospital", "--plain-host", "--external-name", EXTERNAL[0],
          "--external-name", EXTERNAL[1], "--certs", str(certs), "-o", str(tmp_path / "bundle")])
    assert "HFLEET_SITE_HUB:?set HFLEET_SITE_HUB=<host of site rank 0>:50060" in \
        (tmp_path / "bundle" / "run-worker.sh").read_text()


@pytest.mark.parametrize(("store", "volume"), [(None, True), ("s3://team/ckpt", False)])
def test_snapshotting_shards_keep_snapshots_where_a_restarted_pod_finds_them(tmp_path, store, volume):
    # Prepare
    job = copy.deepcopy(JOB)
    job["ps"]["snapshot_every_steps"] = 50
    if store:
        job["checkpoint"] = {"store": store}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))

    # Execute
    manifests = render_job_file(path, RenderOptions(credentials=CredentialSource(placeholders=True)))

    # Assert
    (shards,) = [m for m in manifests if m["kind"] == "StatefulSet"]
    kubernetes_validate.validate(shards, K8S_VERSION, strict=True)
    container = shards["spec"]["template"]["spec"]["containers"][0]
    if volume:  # a local store would die with the pod: one claim per shard instead
        assert shards["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "snapshots"
        assert {"name": "snapshots", "mountPath": "/var/lib/hfleet/snapshots"} in container["volumeMounts"]
        assert container["command"][container["command"].index("--snapshot-store") + 1] == \
            "file:///var/lib/hfleet/snapshots"
    else:  # the shards write to the job's store, with the store Secret's credentials
        assert "volumeClaimTemplates" not in shards["spec"] and "--snapshot-store" not in container["command"]
        assert container["envFrom"] == [{"secretRef": {"name": "digits-hybrid-store", "optional": True}}]
