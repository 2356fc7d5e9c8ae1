"""The deterministic-mode checks shared by the CPU and CUDA tests: one prompt's logits
alone, chunked and beside other sequences (a runner), and eight seeded and eight greedy
requests run through a real engine in batches of a given size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.config import parse_config
from services.engine.factory import build_engine
from services.engine.runner.torch_runner import TorchRunner
from tests.support.engine_factory import req, run_all
from tests.support.tiny_model import batch, seq

PROMPT = [(11 * j + 5) % 128 for j in range(23)]
BLOCKS = list(range(8))  # 32 slots at block size 4
OTHERS = [[(7 * i + 3 * j) % 128 for j in range(4 + 3 * i)] for i in range(6)]
OTHER_BLOCKS = [list(range(8 + 6 * i, 14 + 6 * i)) for i in range(6)]


@dataclass
class AloneChunkedMixed:
    """The prompt's last logits three ways, and the runners that computed the first and
    the last (their caches hold the prompt: a test may go on decoding)."""

    want: torch.Tensor
    chunked: torch.Tensor
    mixed: torch.Tensor
    alone_runner: TorchRunner
    mixed_runner: TorchRunner


def alone_chunked_mixed(make_runner: Callable[[], TorchRunner]) -> AloneChunkedMixed:
    """``PROMPT``'s last logits: prefilled whole and alone; in chunks of 5; as a chunk beside
    six decoding sequences (``OTHERS``), each on a fresh runner (block size 4)."""
    alone = make_runner()
    want = alone.logits_for(batch(seq("p", PROMPT, 0, BLOCKS)))

    chunked = make_runner()
    for start in range(0, 20, 5):  # four chunks of 5, then the last 3 with its logits
        chunked.execute(batch(seq("p", PROMPT[start:start + 5], start, BLOCKS, sample=False)))
    got_chunked = chunked.logits_for(batch(seq("p", PROMPT[20:], 20, BLOCKS)))

    mixed = make_runner()
    mixed.execute(batch(*[seq(f"o{i}", o[:-1], 0, OTHER_BLOCKS[i], sample=False) for i, o in enumerate(OTHERS)]))
    # the prompt's first 20 tokens as a chunk beside six decodes, then its last 3 beside them again
    b = [seq("p", PROMPT[:20], 0, BLOCKS, sample=False)]
    b += [seq(f"o{i}", o[-1:], len(o) - 1, OTHER_BLOCKS[i]) for i, o in enumerate(OTHERS)]
    mixed.execute(batch(*b))
    b = [seq(f"o{i}", [1], len(o), OTHER_BLOCKS[i]) for i, o in enumerate(OTHERS)]
    got_mixed = mixed.logits_for(batch(*b[:3], seq("p", PROMPT[20:], 20, BLOCKS), *b[3:]))[3:4]
    return AloneChunkedMixed(want, got_chunked, got_mixed, alone, mixed)

TOPICS = ["the sea", "a robot", "Paris", "bread", "the moon", "a violin", "winter", "coffee"]


def _mine() -> list:
    """Eight seeded (temperature 1) and eight greedy requests."""
    out = []
    for i, topic in enumerate(TOPICS):
        prompt = [1 + (ord(c) * 31 + k) % 5000 for k, c in enumerate(f"Write three sentences about {topic}.")]
        out += [req(f"s{i}", prompt, max_tokens=24, temperature=1.0, seed=i),
                req(f"g{i}", prompt, max_tokens=24, temperature=0.0)]
    return out


def _pad(n: int) -> list:
    return [req(f"x{j}", [1 + (97 * j + 13 * k) % 5000 for k in range(6 + j % 11)], max_tokens=24,
                temperature=1.0, seed=j) for j in range(n)]


def seeded_texts(engine_cfg: dict, size: int, repeat: bool = False, model: str | None = None) -> dict[str, list[int]]:
    """Each of the sixteen requests' tokens, run in batches of ``size`` requests (padded
    with other seeded prompts), every batch one engine run; ``repeat``: each batch twice,
    the second kept (prefix cache hits). ``model``: model.path (default: the real model)."""
    cfg: dict = {"engine": {"runner": "torch", "num_kv_blocks": 2048, "max_num_seqs": 64, **engine_cfg}}
    if model is not None:
        cfg["model"] = {"path": model}
    eng = build_engine(parse_config(cfg)).engine
    mine = _mine()
    per = min(size, len(mine))
    out: dict[str, list[int]] = {}
    for k in range(0, len(mine), per):
        group = mine[k:k + per] + _pad(size - per)
        for _ in range(2 if repeat else 1):
            for r in group:
                eng.add_request(r)
            got = run_all(eng)
        out.update({rid: t for rid, t in got.items() if rid[0] in "sg"})
    return out
