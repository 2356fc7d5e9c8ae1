"""The Kubernetes actuator: the ``scale`` subresource of the prefill and decode Deployments
(deploy/k8s/prefill.yaml, decode.yaml), through the official client.

``current`` is each Deployment's ``spec.replicas`` (what runs or starts): a count someone
changed by hand (``kubectl scale``) is reported as it is, and the planner's loop adopts it
instead of fighting it (services/planner/loop.py). ``apply`` patches only the Deployments
whose count changes. A scaled-down pod gets SIGTERM from the kubelet: the worker leaves
discovery first and drains (services/common/lifecycle.py) within the pod's
``terminationGracePeriodSeconds``.

NOTE: tested against a fake API server serving the deploy/k8s objects
(tests/integration/planner/test_kubernetes_actuator.py), never a live cluster
(docs/operations.md says so).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kubernetes import client, config

from services.planner.decision import Split
from services.planner.signals import Role

_POD_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def api_client(namespace: str | None) -> tuple[client.ApiClient, str]:
    """In a pod: its service account and namespace; elsewhere: the kubeconfig's context."""
    try:
        config.load_incluster_config()
        in_pod = True
    except config.ConfigException:
        config.load_kube_config()
        in_pod = False
    if namespace is None:
        namespace = _POD_NAMESPACE.read_text().strip() if in_pod else "default"
    return client.ApiClient(), namespace


class KubernetesActuator:
    def __init__(self, api: client.ApiClient, namespace: str, deployments: dict[Role, str]) -> None:
        self._api = api
        self._apps = client.AppsV1Api(api)
        self._namespace = namespace
        self._deployments = deployments

    def _read(self, role: Role) -> int:
        scale = self._apps.read_namespaced_deployment_scale(self._deployments[role], self._namespace)
        return int(scale.spec.replicas or 0)

    def _patch(self, role: Role, replicas: int) -> None:
        self._apps.patch_namespaced_deployment_scale(
            self._deployments[role], self._namespace, {"spec": {"replicas": replicas}})

    async def current(self) -> Split:
        # NOTE: the client is blocking: each call runs in a thread, off the event loop
        prefill, decode = await asyncio.gather(asyncio.to_thread(self._read, Role.PREFILL),
                                               asyncio.to_thread(self._read, Role.DECODE))
        return Split(prefill=prefill, decode=decode)

    async def apply(self, desired: Split) -> None:
        now = await self.current()
        for role, want, have in ((Role.PREFILL, desired.prefill, now.prefill),
                                 (Role.DECODE, desired.decode, now.decode)):
            if want != have:
                await asyncio.to_thread(self._patch, role, want)

    async def close(self) -> None:
        await asyncio.to_thread(self._api.close)
