"""NetworkPolicies: who may open a connection to which of the job's pods.

Every pod of the job denies all ingress (`default_deny`); what is allowed is added back,
port by port:

- shards (gRPC and bulk ports) from the job's worker pods of this cluster and, in the
  shard site's bundle of the hybrid topology, from the other sites' source addresses
  (``--ingress-cidr``, one or more CIDRs: the other sites reach the shards through their
  LoadBalancer Services, which keep the client's address with
  ``externalTrafficPolicy: Local``);
- an aggregating site's hub (the leader, site rank 0) from that site's worker pods only;
- a collective job's pods from the pods of the same job (rendezvous and AllReduce ports
  are chosen by the launchers);
- the metrics port of every pod from the namespace Prometheus runs in
  (``--metrics-namespace``).

Egress is left open: workers dial the shards' external names and the checkpoint store,
whose addresses the rendering cannot know; the shards still refuse any peer without the
CA's certificate and a token bound to a worker of the job.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from hybridfleet.errors import SpecError
from hybridfleet.k8s.common import PS_BULK_PORT, PS_PORT, Manifest, RenderOptions, dns_name, labels, metadata
from hybridfleet.k8s.ps import SITE_HUB_PORT, aggregates, site_labels
from hybridfleet.k8s.scrape import METRICS_PORT
from hybridfleet.spec.models import JobSpec

JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"  # what the JobSet controller puts on a TrainJob's pods


def check_cidrs(cidrs: tuple[str, ...]) -> tuple[str, ...]:
    """``cidrs`` as given when each is an IPv4/IPv6 network (``203.0.113.0/24``); SpecError naming the flag."""
    for cidr in cidrs:
        try:
            ipaddress.ip_network(cidr, strict=True)
        except ValueError as err:
            raise SpecError(f"--ingress-cidr: {cidr!r} is not a network address with a prefix length ({err})") from None
    return cidrs


def job_selector(spec: JobSpec) -> dict[str, str]:
    """Labels every pod of the job carries (its pod templates' labels all include these)."""
    base = labels(spec, "-")
    return {k: base[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance")}


def _policy(spec: JobSpec, name: str, selector: dict[str, str], ingress: list[dict[str, Any]]) -> Manifest:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(spec, name, "network-policy"),
            "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"], "ingress": ingress}}


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def default_deny(spec: JobSpec, selector: dict[str, str] | None = None) -> Manifest:
    """No ingress to any pod of the job unless another policy allows it."""
    return _policy(spec, dns_name(spec.name, "default-deny"), selector or job_selector(spec), [])


def metrics_policy(spec: JobSpec, options: RenderOptions, selector: dict[str, str] | None = None) -> Manifest:
    """The metrics port of every pod, from pods of the namespace ``options.metrics_namespace``."""
    source = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": options.metrics_namespace}}}
    return _policy(spec, dns_name(spec.name, "metrics"), selector or job_selector(spec),
                   [{"from": [source], "ports": _tcp(METRICS_PORT)}])


def ps_policies(spec: JobSpec, options: RenderOptions, sites: list[str], with_shards: bool) -> list[Manifest]:
    """The policies of a parameter-server bundle holding ``sites``' workers (and the shards if ``with_shards``)."""
    out = [default_deny(spec)]
    if with_shards:
        ports = _tcp(PS_PORT) if spec.ps.transport == "grpc" else _tcp(PS_PORT, PS_BULK_PORT)
        rules = [{"from": [{"podSelector": {"matchLabels": labels(spec, "worker")}}], "ports": ports}]
        if options.external_names:
            rules.append({"from": [{"ipBlock": {"cidr": cidr}} for cidr in options.ingress_cidrs], "ports": ports})
        out.append(_policy(spec, dns_name(spec.name, "ps"), labels(spec, "ps"), rules))
    for site in sites:
        if aggregates(spec, site):
            out.append(_policy(spec, dns_name(spec.name, "worker", site, "hub"), site_labels(spec, site, 0),
                               [{"from": [{"podSelector": {"matchLabels": site_labels(spec, site)}}],
                                 "ports": _tcp(SITE_HUB_PORT)}]))
    return [*out, metrics_policy(spec, options)]


def collective_policies(spec: JobSpec, options: RenderOptions) -> list[Manifest]:
    """The policies of a collective job: its pods accept its own pods (any port) and the metrics scrape.

    A Kubeflow v1 job's pods carry the job's labels; a TrainJob's pods get theirs from the
    runtime, so they are selected by the JobSet controller's label instead.
    """
    selector = {JOBSET_LABEL: spec.name} if options.api == "v2" else labels(spec, "collective")
    peers = _policy(spec, dns_name(spec.name, "peers"), selector,
                    [{"from": [{"podSelector": {"matchLabels": selector}}]}])
    return [default_deny(spec, selector), peers, metrics_policy(spec, options, selector)]


def network_policies(spec: JobSpec, options: RenderOptions) -> list[Manifest]:
    """Every NetworkPolicy of the bundle ``options`` describes (the options checked by `check_options`)."""
    if spec.mode == "collective":
        return collective_policies(spec, options)
    with_shards = options.site is None or options.site == options.shard_site
    sites = list(spec.sites) if options.site is None else [options.site]
    return ps_policies(spec, options, sites, with_shards)
