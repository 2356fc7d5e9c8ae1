"""The Kubernetes actuator against a fake API server holding deploy/k8s's prefill and decode
Deployments: it reads and patches their scale subresource with the official client, and a
count changed by hand is adopted by the planner's loop, not fought."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from services.planner.actuators.kubernetes import KubernetesActuator
from services.planner.decision import Action, Split
from services.planner.loop import ADOPTED, PlannerLoop
from services.planner.signals import Role
from tests.support.fake_k8s import FakeK8s
from tests.support.planner_fakes import QueuePolicy, ScriptedCollector


@pytest.fixture
def fake() -> Iterator[FakeK8s]:
    f = FakeK8s("tandem")
    yield f
    f.close()


def _actuator(fake: FakeK8s) -> KubernetesActuator:
    conf = client.Configuration(host=fake.url)
    return KubernetesActuator(client.ApiClient(conf), "tandem",
                              {Role.PREFILL: "prefill", Role.DECODE: "decode"})


async def test_reads_the_deployments_and_scales_only_what_changes(fake: FakeK8s) -> None:
    act = _actuator(fake)
    assert await act.current() == Split(1, 1)  # deploy/k8s's replicas
    await act.apply(Split(1, 3))
    assert fake.patches == [("decode", 3)] and fake.replicas("decode") == 3
    await act.apply(Split(0, 2))
    assert fake.patches == [("decode", 3), ("prefill", 0), ("decode", 2)]
    assert await act.current() == Split(0, 2)
    await act.close()


async def test_a_hand_scaled_deployment_is_adopted_not_fought(fake: FakeK8s) -> None:
    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    loop = PlannerLoop(QueuePolicy(), ScriptedCollector([5000] * 4), _actuator(fake),
                       interval_s=10.0, cooldown_s=30.0, clock=clock)
    d = await loop.step()
    assert (d.action, d.desired) == (Action.SCALE_UP, Split(1, 2))
    assert fake.patches == [("decode", 2)]
    fake.scale_by_hand("decode", 5)  # kubectl scale deployment/decode --replicas=5
    clock.t = 10.0
    d = await loop.step()
    assert (d.action, d.reason, d.current, d.desired) == (Action.HOLD, ADOPTED, Split(1, 5), Split(1, 5))
    assert fake.patches == [("decode", 2)] and fake.replicas("decode") == 5
    clock.t = 45.0  # after the cooldown the policy moves on from the adopted count
    d = await loop.step()
    assert d.desired == Split(1, 6) and fake.patches[-1] == ("decode", 6)
