"""The internal gRPC plane with a cluster token: a call without it (or with a wrong one) is
refused UNAUTHENTICATED before its bytes are read, on every method including the raw-bytes
KvTransfer; tandem's own clients carry it and are served."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from services.api.sampling import SamplingParams
from services.common.address_book import ChannelPool
from services.common.env import CLUSTER_TOKEN
from services.common.grpc_auth import TOKEN_KEY, call_metadata
from services.gen import request_pb2, worker_pb2, worker_pb2_grpc
from services.processor.worker_client import DecodeWorkerClient
from tests.support.mock_cluster import mock_cluster_cfg
from tests.support.stack import worker_decode_node


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv(CLUSTER_TOKEN, "s3cret-cluster-token")
    call_metadata.cache_clear()
    yield "s3cret-cluster-token"
    call_metadata.cache_clear()


async def _code(call) -> grpc.StatusCode:
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.mark.asyncio
async def test_calls_without_the_token_are_refused_and_tandems_clients_are_served(token: str) -> None:
    cfg = mock_cluster_cfg()
    async with worker_decode_node(cfg) as node:
        req = worker_pb2.GenerateRequest(request_id="r", token_ids=[5, 6],
                                         sampling=request_pb2.SamplingParams(max_tokens=2))
        async with grpc.aio.insecure_channel(node.address) as ch:
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            assert await _code(stub.Generate(req)) == grpc.StatusCode.UNAUTHENTICATED
            assert await _code(stub.Generate(req, metadata=((TOKEN_KEY, "guess"),))
                               ) == grpc.StatusCode.UNAUTHENTICATED
            kv = ch.stream_unary("/tandem.worker.DecodeWorker/KvTransfer")
            assert await _code(kv(iter((b"\x0a\x01r",)))) == grpc.StatusCode.UNAUTHENTICATED
            garbage = ch.unary_stream("/tandem.worker.DecodeWorker/Generate")
            assert await _code(garbage(b"\xff\xff")) == grpc.StatusCode.UNAUTHENTICATED
        assert node.worker.generate_calls == []  # nothing reached the worker
        pool = ChannelPool()
        try:
            outs = [o async for o in DecodeWorkerClient(pool).generate(
                node.address, "ok", [5, 6], SamplingParams(temperature=0, max_tokens=3))]
        finally:
            await pool.close()
        assert sum(len(o.token_ids) for o in outs) == 3 and outs[-1].finished
        assert node.worker.generate_calls == ["ok"]


def test_the_token_comes_from_the_variable_or_the_file_it_names(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from services.common.env import CLUSTER_TOKEN_FILE, cluster_token

    monkeypatch.delenv(CLUSTER_TOKEN, raising=False)
    monkeypatch.delenv(CLUSTER_TOKEN_FILE, raising=False)
    assert cluster_token() is None
    (tmp_path / "token").write_text("from-a-secret\n")
    monkeypatch.setenv(CLUSTER_TOKEN_FILE, str(tmp_path / "token"))
    assert cluster_token() == "from-a-secret"
    monkeypatch.setenv(CLUSTER_TOKEN, "from-the-env")
    assert cluster_token() == "from-the-env"
