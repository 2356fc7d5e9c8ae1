"""Build a Hugging Face `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported. The pre-tokenizer is
chosen by `tokenizer.ggml.pre`, the name llama.cpp gives each HF pre-tokenizer it knows;
SmolLM2's "smollm" is HF's Digits(individual) followed by GPT-2 byte-level splitting.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from services.model.errors import UnsupportedModelError
from services.model.gguf_file import open_gguf

# llama.cpp token types (llama_token_type): 3 = control (special), 4 = user-defined.
_CONTROL, _USER_DEFINED = 3, 4
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str, source: Path) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("gpt-2", "default"):
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "qwen2":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"), raw_bytes])
    if pre == "llama-bpe":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), raw_bytes])
    raise UnsupportedModelError(
        f"tokenizer pre-tokenizer {pre!r} in {source} is not supported; "
        "supported: smollm, gpt-2, default, qwen2, llama-bpe"
    )


@dataclass(frozen=True)
class GgufTokenizerData:
    tokenizer: HFTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    chat_template: str | None


def load_gguf_tokenizer(path: Path) -> GgufTokenizerData:
    """Read the tokenizer stored in the GGUF at `path`."""
    metadata = open_gguf(path).metadata

    def field(key: str, default: object = None) -> object:
        return metadata.get(key, default)

    model = field("tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedModelError(
            f"tokenizer model {model!r} in {path} is not supported; supported: gpt2 (byte-level BPE)"
        )
    tokens: list[str] = field("tokenizer.ggml.tokens")  # type: ignore[assignment]
    types: list[int] = field("tokenizer.ggml.token_type", [1] * len(tokens))  # type: ignore[assignment]
    if len(types) != len(tokens):
        raise UnsupportedModelError(
            f"{path}: {len(types)} token types for {len(tokens)} tokens in tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]  # type: ignore[union-attr]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tk = HFTokenizer(bpe)
    tk.pre_tokenizer = _pre_tokenizer(str(field("tokenizer.ggml.pre", "default")), path)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL])
    tk.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED])

    def token_id(key: str) -> int | None:
        v = field(key)
        return None if v is None else int(v)  # type: ignore[call-overload]

    bos = token_id("tokenizer.ggml.bos_token_id")
    if bool(field("tokenizer.ggml.add_bos_token", False)) and bos is not None:
        bos_tok = tokens[bos]
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos_tok} $A", pair=f"{bos_tok} $A {bos_tok} $B", special_tokens=[(bos_tok, bos)])
    return GgufTokenizerData(
        tokenizer=tk,
        bos_token_id=bos,
        eos_token_id=token_id("tokenizer.ggml.eos_token_id"),
        eot_token_id=token_id("tokenizer.ggml.eot_token_id"),
        chat_template=field("tokenizer.chat_template"),  # type: ignore[arg-type]
    )
