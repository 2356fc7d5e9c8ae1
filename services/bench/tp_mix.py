"""The mixed requests `tandem bench tp` sends: short and long prompts, a share of them heavy
(an image on a LLaVA model, else raw payload bytes that TpRunner.extra_payload sends with
the request), arriving as a seeded Poisson process. One spec gives the same requests and
the same arrival times to every (TP size, broadcast mode) run, so their rows compare."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from services.api.sampling import SamplingParams
from services.bench.arrivals import ArrivalSpec, schedule
from services.engine.request import GenerateRequest
from services.model.image_spans import ImageSpan


@dataclass(frozen=True, slots=True)
class MixSpec:
    requests: int
    rate: float  # arrivals per second
    short_len: int  # prompt tokens of a short request
    long_len: int  # ... of a long one
    long_share: float  # share of long requests
    heavy_share: float  # share carrying an image (LLaVA) or ``payload_kib`` of raw bytes
    payload_kib: int
    output_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("requests", "short_len", "long_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("long_share", "heavy_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.payload_kib < 0:
            raise ValueError(f"payload_kib must be >= 0, got {self.payload_kib}")


@dataclass(frozen=True, slots=True)
class ImageShape:
    """A LLaVA model's image in the prompt: ``rows`` placeholder tokens ``token_id``, each
    replaced by a ``hidden``-wide embedding row."""

    token_id: int
    rows: int
    hidden: int


@dataclass(slots=True)
class Mix:
    """Requests in arrival order, their offsets (s from the first) and the heavy ones' ids
    (on a text model, the requests ``extra_payload`` gives the payload to)."""

    requests: list[GenerateRequest]
    offsets: list[float]
    heavy: frozenset[str]
    payload: bytes


def make_mix(spec: MixSpec, vocab: int, image: ImageShape | None = None,
             dtype: torch.dtype = torch.float32, prefix: str = "tp") -> Mix:
    """Fresh requests for one run (the engine keeps what it is given); the same for the
    same spec. Embedding values are random: the bench measures moving and prefilling them."""
    gen = torch.Generator().manual_seed(spec.seed)
    # NOTE: exact shares, placed at random and independently: a small run still mixes.
    n = spec.requests
    long_ids = set(torch.randperm(n, generator=gen)[:round(n * spec.long_share)].tolist())
    heavy_ids = set(torch.randperm(n, generator=gen)[:round(n * spec.heavy_share)].tolist())
    sampling = SamplingParams(temperature=0, max_tokens=spec.output_len, ignore_eos=True)
    requests: list[GenerateRequest] = []
    heavy: set[str] = set()
    for i in range(spec.requests):
        long, is_heavy = i in long_ids, i in heavy_ids
        rid = f"{prefix}-{i}-{'long' if long else 'short'}{'-heavy' if is_heavy else ''}"
        prompt = torch.randint(100, vocab, (spec.long_len if long else spec.short_len,), generator=gen).tolist()
        images: tuple[ImageSpan, ...] = ()
        if is_heavy:
            heavy.add(rid)
        if is_heavy and image is not None:
            # The image after the text, then one text token; its own hash, so no prefix hits.
            prompt = [100 if t == image.token_id else t for t in prompt]
            digest = hashlib.sha256(f"{prefix}-{spec.seed}-{i}".encode()).hexdigest()
            embeds = torch.randn((image.rows, image.hidden), generator=gen).to(dtype)  # (rows, hidden)
            images = (ImageSpan(len(prompt), image.rows, digest).with_embeds(embeds),)
            prompt = [*prompt, *[image.token_id] * image.rows, 100]
        requests.append(GenerateRequest(rid, prompt, sampling, images=images))
    offsets = schedule(ArrivalSpec("poisson", spec.rate, seed=spec.seed), spec.requests)
    assert offsets is not None  # NOTE: only "concurrency" arrivals have no schedule
    payload = b"" if image is not None else torch.randint(0, 256, (spec.payload_kib * 1024,), generator=gen,
                                                           dtype=torch.uint8).numpy().tobytes()
    return Mix(requests, offsets, frozenset(heavy), payload)
