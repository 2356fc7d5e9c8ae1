"""The codecs of services/api and the error table: each message survives its proto both
ways, a bad value is refused where a process reads it, and an error keeps its kind, code
and param across gRPC."""

from __future__ import annotations

import grpc
import pytest

from services.api.outputs import FinishReason, TokenLogprob, TokenOutput, Usage
from services.api.prefill import PrefillJob
from services.api.prefill_codec import job_from_bytes, job_to_pb
from services.api.processor import ChatMessage, Delta, ProcessRequest, TextLogprob, Tool
from services.api.processor_codec import delta_from_pb, delta_to_pb, request_from_pb, request_to_pb
from services.api.request_codec import sampling_from_pb, sampling_to_pb
from services.api.sampling import SamplingParams
from services.api.structured import StructuredKind, StructuredOutput
from services.api.worker_codec import (
    generate_request_from_pb,
    generate_request_to_pb,
    output_from_pb,
    output_to_pb,
)
from services.common.errors import (
    ERRORS,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    ServingError,
    Unavailable,
    from_rpc_error,
    kind_of,
)
from services.engine.async_engine import EngineDeadError
from services.engine.scheduler import InvalidRequestError
from services.gen import request_pb2, worker_pb2

FULL = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=-(2**63), max_tokens=12,
                      stop=("\n\n", "END"), stop_token_ids=(7, 9), ignore_eos=True,
                      seed_step_offset=3, presence_penalty=-0.5, frequency_penalty=1.25,
                      repetition_penalty=1.1, logit_bias=((3, -100.0), (40, 2.5)), min_tokens=4,
                      logprobs=0, n=3, structured=StructuredOutput.json_schema({"type": "object"}),
                      min_p=0.05, prompt_logprobs=2)


def test_sampling_round_trips_every_field_and_keeps_unset_apart_from_zero() -> None:
    assert sampling_from_pb(sampling_to_pb(FULL)) == FULL
    default = SamplingParams()
    assert sampling_from_pb(sampling_to_pb(default)) == default
    assert default.seed is None and default.max_tokens is None
    assert sampling_from_pb(sampling_to_pb(SamplingParams(seed=0))).seed == 0
    assert sampling_from_pb(request_pb2.SamplingParams()) == default  # a bare caller's message
    greedy = sampling_from_pb(request_pb2.SamplingParams(temperature=0.0))
    assert greedy.temperature == 0 and greedy.greedy


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", float("inf")), ("temperature", float("nan")), ("temperature", -1.0),
    ("top_p", 0.0), ("top_p", float("nan")), ("top_p", -1.0), ("top_k", 1 << 21),
    ("min_p", 1.5), ("min_p", float("nan")), ("stop", [""]), ("stop", ["x"] * 17), ("stop", ["x" * 257]),
    ("stop_token_ids", list(range(65))),
    ("presence_penalty", 2.5), ("frequency_penalty", float("nan")), ("repetition_penalty", 0.0),
    ("logprobs", 21), ("prompt_logprobs", 21), ("n", 17),
])
def test_a_bad_value_on_the_wire_is_refused_naming_the_field(field: str, value: object) -> None:
    msg = request_pb2.SamplingParams()
    if isinstance(value, list):
        getattr(msg, field).extend(value)
    else:
        setattr(msg, field, value)
    with pytest.raises(ValueError, match=f"^{field}:"):
        sampling_from_pb(msg)
    with pytest.raises(ValueError, match=f"^sampling.{field}:"):
        generate_request_from_pb(worker_pb2.GenerateRequest(request_id="r", token_ids=[1],
                                                            sampling=msg))


def test_generate_request_and_outputs_round_trip() -> None:
    req = generate_request_from_pb(generate_request_to_pb("r1", [5, 6, 7], FULL))
    assert (req.request_id, req.prompt_token_ids, req.sampling) == ("r1", [5, 6, 7], FULL)
    with pytest.raises(ValueError, match="request_id"):
        generate_request_from_pb(generate_request_to_pb("", [1], FULL))
    mid = TokenOutput("r1", [4])
    assert output_from_pb("r1", output_to_pb(mid, 1)) == mid
    last = TokenOutput("r1", [8, 9], True, FinishReason.LENGTH, 3, 2)
    pb = output_to_pb(last, 5)
    assert pb.usage.completion_tokens == 5
    assert output_from_pb("r1", pb) == last
    lps = [TokenLogprob(8, -0.5, ((8, -0.5), (2, -1.25))), TokenLogprob(9, -2.0)]
    with_lp = TokenOutput("r1", [8, 9], logprobs=lps, index=2)
    assert output_from_pb("r1", output_to_pb(with_lp, 2)) == with_lp
    with_prompt_lp = TokenOutput("r1", [8], logprobs=lps[:1], prompt_logprobs=lps)
    assert output_from_pb("r1", output_to_pb(with_prompt_lp, 1)) == with_prompt_lp


def test_a_moved_request_round_trips_its_source_and_needs_a_produced_token() -> None:
    from dataclasses import replace

    from services.api.move import MoveSource

    src = MoveSource("decode-1", "10.0.0.2:9301", bytes(range(32)))
    req = generate_request_from_pb(generate_request_to_pb("r1", [5, 6, 7], FULL, move_from=src))
    assert req.move_from == src and req.sampling == FULL
    assert generate_request_from_pb(generate_request_to_pb("r1", [5, 6, 7], FULL)).move_from is None
    fresh = replace(FULL, seed_step_offset=0)
    with pytest.raises(ValueError, match="move_from"):  # nothing produced: nothing to move
        generate_request_from_pb(generate_request_to_pb("r1", [5, 6, 7], fresh, move_from=src))
    assert str(src.token) not in repr(src)  # the token never reaches a log line


def test_process_request_and_deltas_round_trip() -> None:
    for req in (ProcessRequest("a", messages=(ChatMessage("user", "hi"),), sampling=FULL, model="m"),
                ProcessRequest("b", prompt="text"),
                ProcessRequest("c", prompt_ids=(1, 2, 3), sampling=SamplingParams(temperature=0)),
                ProcessRequest("d", prompt="text", echo=True),
                ProcessRequest("e", prompt="text", tools=(Tool("f"),), parallel_tool_calls=False)):
        assert request_from_pb(request_to_pb(req)) == req
    lp = TextLogprob("\ufffd", -0.5, (("\ufffd", -0.5), ("Hello", -1.25)), b"\xe6", (b"\xe6", b"Hello"))
    for d in (Delta("x"), Delta("", FinishReason.STOP, Usage(3, 4, 1)),
              Delta("Hi", logprobs=(lp,), index=2),
              Delta("Hi", logprobs=(TextLogprob("H", None), lp, TextLogprob("i", 0.0)))):
        assert delta_from_pb(delta_to_pb(d)) == d


def test_prefill_job_round_trips_and_garbage_is_a_value_error() -> None:
    job = PrefillJob("r", (1, 2, 3), FULL, "decode-0", "127.0.0.1:9", 1, 2, 123, 2, "host")
    assert job_from_bytes(job_to_pb(job).SerializeToString()) == job
    with pytest.raises(ValueError):
        job_from_bytes(b"\xff\xff\xff")


class _RpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str, meta: tuple = ()) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(*meta), details)


@pytest.mark.parametrize("err", [
    InvalidRequest("bad", code="context_length_exceeded", param="messages"),
    ModelNotFound("no such model", param="model", code="model_not_found"),
    Unavailable("no workers"), Overloaded("full", code="overloaded"),
])
def test_an_error_crosses_grpc_as_the_same_kind_with_its_code_and_param(err: ServingError) -> None:
    k = kind_of(err)
    meta = tuple((key, v) for key, v in (("tandem-error-code", err.code),
                                         ("tandem-error-param", err.param)) if v)
    back = from_rpc_error(_RpcError(k.status, err.message, meta), "peer")
    assert type(back) is type(err)
    assert (back.message, back.code, back.param) == (err.message, err.code, err.param)


def test_unknown_statuses_are_internal_and_engine_errors_share_their_base_row() -> None:
    e = from_rpc_error(_RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"), "decode worker x")
    assert type(e) is ServingError and "decode worker x" in e.message and kind_of(e).http_status == 500
    assert kind_of(InvalidRequestError("x")) is ERRORS[InvalidRequest]
    assert kind_of(EngineDeadError("x")) is ERRORS[Unavailable]
    named = from_rpc_error(_RpcError(grpc.StatusCode.UNAVAILABLE, "draining"), "decode worker y",
                           name_peer=True)
    assert named.message == "decode worker y: draining"
    assert len({k.status for k in ERRORS.values()}) == len(ERRORS)  # the table inverts


def test_a_stop_string_that_is_not_valid_unicode_is_refused_where_it_is_built() -> None:
    """A caller in process (no JSON schema in front) cannot hand the processor a stop string
    that no protobuf or UTF-8 writer would take."""
    with pytest.raises(ValueError, match="^stop: .*surrogate"):
        SamplingParams(stop=("ok", "bad\ud800"))
    assert SamplingParams(stop=("naïve \U0001f600",)).stop == ("naïve \U0001f600",)


@pytest.mark.parametrize("structured", [
    StructuredOutput(StructuredKind.JSON_OBJECT),
    StructuredOutput.json_schema({"type": "array", "items": {"enum": ["a", "b"]}}),
    StructuredOutput(StructuredKind.REGEX, "[0-9]+"),
    StructuredOutput(StructuredKind.CHOICE, choices=("yes", "no way")),
    StructuredOutput(StructuredKind.GRAMMAR, 'start: "a" | "b"'),
])
def test_structured_output_round_trips_each_kind(structured: StructuredOutput) -> None:
    sp = SamplingParams(structured=structured)
    msg = sampling_to_pb(sp)
    assert msg.structured.WhichOneof("kind") == structured.kind.value
    assert sampling_from_pb(msg) == sp


def test_structured_output_with_no_kind_is_a_value_error() -> None:
    msg = sampling_to_pb(SamplingParams())
    msg.structured.SetInParent()
    with pytest.raises(ValueError, match="structured: no kind"):
        sampling_from_pb(msg)
