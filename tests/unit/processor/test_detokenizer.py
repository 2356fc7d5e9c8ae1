"""Incremental detokenization against the real SmolLM2 tokenizer: the emitted pieces must
concatenate to decode(all ids) for text whose characters span several byte-level tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.model.tokenizer import Tokenizer
from services.processor.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "emoji: 🙂🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 done",
    "CJK: 你好，世界。日本語のテキスト、한국어 문장",
    "accents: café naïve résumé Ångström façade, Ελληνικά, кириллица",
    "mixed 🙂 é 你 \n\ttabs  and   spaces 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√",
]


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


def _stream(tok: Tokenizer, ids: list[int], chunk: int) -> list[str]:
    d = IncrementalDetokenizer(tok)
    pieces = [d.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(d.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_pieces_concatenate_to_full_decode(tok: Tokenizer, text: str, chunk: int) -> None:
    ids = tok.encode(text)
    pieces = _stream(tok, ids, chunk)
    assert "".join(pieces) == tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS[1:4])
def test_no_piece_holds_a_broken_character(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    # The text really does split characters across tokens (else this test proves nothing).
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = _stream(tok, ids, 1)
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) < len(ids)  # some tokens were held back


def test_special_tokens_are_skipped(tok: Tokenizer) -> None:
    ids = tok.encode("Hi there") + [tok.eos_token_id]
    assert "".join(_stream(tok, ids, 1)) == "Hi there" == tok.decode(ids)


def test_truncated_character_is_flushed_like_decode(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🚀")
    cut = ids[:-1]  # the model stopped inside the emoji's bytes
    assert tok.decode(cut).endswith("\ufffd")
    assert "".join(_stream(tok, cut, 1)) == tok.decode(cut)


def test_random_token_sequences_round_trip(tok: Tokenizer) -> None:
    import random

    rng = random.Random(7)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert "".join(_stream(tok, ids, rng.randrange(1, 4))) == tok.decode(ids)
