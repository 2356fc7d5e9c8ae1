"""`tandem planner -c FILE [--set k=v]`: the planner as a part of its own (docs/planner.md,
"Running the planner"). Started by `tandem up` (local actuator), compose or Kubernetes
(kubernetes actuator) when ``planner.enabled``.

Every ``planner.interval_s`` it reads the cluster (collect.py), asks the policy for a split
and has the actuator move to it (loop.py); /metrics on ``planner.metrics_port``; registered
in discovery as role ``planner``. SIGTERM/SIGINT: the loop stops between two rounds
(a split being applied is left to the launcher or Kubernetes to finish), exit 0.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import sys
from collections.abc import Callable

from services.common import env, lifecycle
from services.common.config import ClusterConfig, PlannerConfig
from services.common.lifecycle import PartSpec, Setup
from services.common.net import advertised_host
from services.common.service import run_part
from services.planner.actuator import Actuator
from services.planner.collect import LiveCollector
from services.planner.loop import PlannerLoop
from services.planner.metrics import PlannerMetrics
from services.planner.policies import policy_for
from services.planner.policy import Policy
from services.planner.signals import Role
from services.steptime.profile import ProfileError, step_model_for

log = logging.getLogger("tandem.planner")


class PlannerSetupError(RuntimeError):
    """The planner cannot run with this config or environment (the message says why)."""


def build_policy(cfg: ClusterConfig) -> Policy:
    """``TANDEM_PLANNER_POLICY`` ("module:factory", given the PlannerConfig) when set, else
    ``planner.policy`` over the step model ``engine.step_model`` names."""
    pc = cfg.planner
    override = env.planner_policy()
    if override:
        module, _, name = override.partition(":")
        try:
            factory: Callable[[PlannerConfig], Policy] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise PlannerSetupError(f"{env.PLANNER_POLICY}={override}: {e}") from None
        return factory(pc)
    try:
        model = step_model_for(cfg)
    except ProfileError as e:
        raise PlannerSetupError(f"planner.policy={pc.policy} needs engine.step_model: {e}") from None
    return policy_for(cfg, model)


async def build_actuator(cfg: ClusterConfig, part: Setup) -> Actuator:
    pc = cfg.planner
    if pc.actuator == "observe":
        from services.planner.actuators.observe import ObserveActuator

        return ObserveActuator(await part.discovery())
    if pc.actuator == "local":
        from services.planner.actuators.local import LocalActuator

        token = env.cluster_token()
        if token is None:
            raise PlannerSetupError(f"planner.actuator=local needs {env.CLUSTER_TOKEN} "
                                    "(`tandem up` gives it to the planner it starts)")
        return LocalActuator(pc.control_port, token)
    if pc.actuator == "kubernetes":
        from services.planner.actuators.kubernetes import KubernetesActuator, api_client

        api, namespace = api_client(pc.k8s_namespace)
        return KubernetesActuator(api, namespace, {Role.PREFILL: pc.k8s_prefill_deployment,
                                                   Role.DECODE: pc.k8s_decode_deployment})
    raise PlannerSetupError("planner.actuator=sim runs inside `tandem sim`, not `tandem planner`")


async def _build(part: Setup, policy: Policy) -> PartSpec:
    pc = part.cfg.planner
    actuator = await build_actuator(part.cfg, part)
    if hasattr(actuator, "close"):
        part.on_close(actuator.close, "actuator")
    collector = LiveCollector(part.nc, part.cfg.namespace, await part.discovery())
    await collector.start()
    part.on_close(collector.close, "collector")
    metrics = PlannerMetrics()
    loop = PlannerLoop(policy, collector, actuator, interval_s=pc.interval_s,
                       cooldown_s=pc.cooldown_s, metrics=metrics)

    async def start_loop(_bound: lifecycle.Bound) -> None:
        if pc.enabled:
            part.task(loop.run(part.stop), "planner loop")
        else:  # a deploy that always runs the part (k8s): the config switches it on
            log.info("planner: planner.enabled is false: not deciding")

    return PartSpec(
        advertised_host(part.host), 0.0, registry=metrics.registry, metrics_port=pc.metrics_port,
        before_register=start_loop,
        announce=lambda b: log.info("planner: policy %s, %s actuator, every %g s; metrics :%s",
                                    type(policy).__name__, pc.actuator, pc.interval_s, b.metrics_port))


async def serve(cfg: ClusterConfig, replica: int = 0) -> None:
    # NOTE: httpx logs every request at INFO: the scrapes and the actuator's calls, each round
    logging.getLogger("httpx").setLevel(logging.WARNING)
    policy = build_policy(cfg)  # before NATS: a planner without a policy stops at once
    await lifecycle.run(cfg, "planner", replica, functools.partial(_build, policy=policy))


def main(args: argparse.Namespace) -> int:
    args.replica = 0  # one planner per cluster
    try:
        return run_part(args, serve)
    except PlannerSetupError as e:
        print(f"tandem planner: {e}", file=sys.stderr)
        return 2
