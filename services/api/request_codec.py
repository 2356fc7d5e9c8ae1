"""proto/request.proto <-> sampling.py, structured.py, outputs.py: sampling, finish, usage."""

from __future__ import annotations

from services.api.outputs import FinishReason, TokenLogprob, Usage
from services.api.sampling import SamplingParams
from services.api.structured import StructuredKind, StructuredOutput
from services.gen import request_pb2

_FINISH_TO_PB = {
    FinishReason.STOP: request_pb2.STOP,
    FinishReason.LENGTH: request_pb2.LENGTH,
    FinishReason.ABORT: request_pb2.ABORT,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}
_DEFAULT = SamplingParams()


def sampling_to_pb(s: SamplingParams) -> request_pb2.SamplingParams:
    msg = request_pb2.SamplingParams(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, stop=s.stop,
        stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos,
        seed_step_offset=s.seed_step_offset, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, logit_bias=dict(s.logit_bias),
        min_tokens=s.min_tokens, n=s.n, min_p=s.min_p)
    if s.seed is not None:
        msg.seed = s.seed
    if s.max_tokens is not None:
        msg.max_tokens = s.max_tokens
    if s.repetition_penalty != _DEFAULT.repetition_penalty:
        msg.repetition_penalty = s.repetition_penalty
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    if s.structured is not None:
        msg.structured.CopyFrom(structured_to_pb(s.structured))
    return msg


def structured_to_pb(s: StructuredOutput) -> request_pb2.StructuredOutput:
    k = s.kind
    if k is StructuredKind.JSON_OBJECT:
        return request_pb2.StructuredOutput(json_object=True)
    if k is StructuredKind.CHOICE:
        return request_pb2.StructuredOutput(
            choice=request_pb2.StructuredOutput.Choices(choices=s.choices))
    return request_pb2.StructuredOutput(**{k.value: s.spec})


def structured_from_pb(m: request_pb2.StructuredOutput) -> StructuredOutput:
    """Raises ValueError naming what is wrong (StructuredOutput checks its shape)."""
    which = m.WhichOneof("kind")
    if which is None:
        raise ValueError("structured: no kind is set")
    kind = StructuredKind(which)
    if kind is StructuredKind.JSON_OBJECT:
        return StructuredOutput(kind)
    if kind is StructuredKind.CHOICE:
        return StructuredOutput(kind, choices=tuple(m.choice.choices))
    return StructuredOutput(kind, getattr(m, which))


def sampling_from_pb(m: request_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the bad field (SamplingParams checks every value)."""
    d = _DEFAULT
    return SamplingParams(
        temperature=m.temperature if m.HasField("temperature") else d.temperature,
        top_k=m.top_k, top_p=m.top_p if m.HasField("top_p") else d.top_p, min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None,
        max_tokens=m.max_tokens if m.HasField("max_tokens") else None,
        stop=tuple(m.stop), stop_token_ids=tuple(m.stop_token_ids), ignore_eos=m.ignore_eos,
        seed_step_offset=m.seed_step_offset, presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty")
        else d.repetition_penalty,
        logit_bias=tuple(sorted(m.logit_bias.items())), min_tokens=m.min_tokens,
        logprobs=m.logprobs if m.HasField("logprobs") else None, n=m.n or 1,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        structured=structured_from_pb(m.structured) if m.HasField("structured") else None)


def request_sampling_from_pb(request_id: str, m: request_pb2.SamplingParams) -> SamplingParams:
    """A request message's id and sampling, checked; ValueError names the bad field."""
    if not request_id:
        raise ValueError("request_id: must not be empty")
    try:
        return sampling_from_pb(m)
    except ValueError as e:
        raise ValueError(f"sampling.{e}") from None


def finish_to_pb(reason: FinishReason | None) -> request_pb2.FinishReason.ValueType:
    return request_pb2.FINISH_REASON_UNSPECIFIED if reason is None else _FINISH_TO_PB[reason]


def finish_from_pb(value: request_pb2.FinishReason.ValueType) -> FinishReason | None:
    """None for UNSPECIFIED (not finished) and for a value this build does not know."""
    return _FINISH_FROM_PB.get(value)


def usage_to_pb(u: Usage) -> request_pb2.Usage:
    return request_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                             cached_tokens=u.cached_tokens)


def usage_from_pb(m: request_pb2.Usage) -> Usage:
    return Usage(m.prompt_tokens, m.completion_tokens, m.cached_tokens)


def logprob_to_pb(lp: TokenLogprob) -> request_pb2.TokenLogprob:
    return request_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                    top_ids=[t for t, _ in lp.top],
                                    top_logprobs=[x for _, x in lp.top])


def logprob_from_pb(m: request_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(m.token_id, m.logprob,
                        tuple(zip(m.top_ids, m.top_logprobs, strict=True)))
