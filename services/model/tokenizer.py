"""The text <-> token-id boundary: one `Tokenizer` over HF `tokenizers`, built from a GGUF
file's metadata or from an HF directory's tokenizer.json (+ tokenizer_config.json).

Thread-safe for concurrent encode/decode (the Rust tokenizer is immutable once built).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from services.model.chat_template import ChatTemplate, ChatTemplateError
from services.model.errors import UnsupportedModelError

# A SentencePiece byte-fallback token: one raw byte.
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet read back: the character a vocabulary entry uses for
    each byte (printable bytes as themselves, the rest shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


# End-of-turn markers of common chat formats (ChatML, Llama 3, Phi-3, Gemma). One counts as a
# stop token when the vocabulary has it and the model's chat template emits it.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as "<s>" or {"content": "<s>", ...}.
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{path} is not valid JSON: {e}") from e


def _pick_template(value: Any) -> str | None:
    # Newer configs may hold a list of named templates; the "default" one is for chat.
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        value = named.get("default")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode/decode and chat-template rendering for one model."""

    def __init__(self, tk: HFTokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None, extra_stop_ids: Sequence[int] = (),
                 source: Path | None = None) -> None:
        self._tk = tk
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.source = source
        self.vocab_size: int = tk.get_vocab_size(with_added_tokens=True)
        self._template = None
        if chat_template is not None:
            names = {"bos_token": bos_token_id, "eos_token": eos_token_id}
            self._template = ChatTemplate(
                chat_template,
                {k: (None if v is None else tk.id_to_token(v)) for k, v in names.items()},
            )
        stops = [i for i in (eos_token_id, *extra_stop_ids) if i is not None]
        for tok in _END_OF_TURN_TOKENS:
            tid = tk.token_to_id(tok)
            if tid is not None and chat_template is not None and tok in chat_template:
                stops.append(tid)
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """Build from a .gguf file or an HF directory holding tokenizer.json."""
        p = Path(path)
        if p.is_file() and p.suffix == ".gguf":
            from services.model.tokenizer_gguf import load_gguf_tokenizer

            d = load_gguf_tokenizer(p)
            return cls(d.tokenizer, bos_token_id=d.bos_token_id, eos_token_id=d.eos_token_id,
                       chat_template=d.chat_template,
                       extra_stop_ids=() if d.eot_token_id is None else (d.eot_token_id,), source=p)
        if p.is_dir():
            return cls._from_hf_dir(p)
        raise FileNotFoundError(f"tokenizer source {p} is neither a .gguf file nor a directory")

    @classmethod
    def _from_hf_dir(cls, d: Path) -> Tokenizer:
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{tj} is missing (only fast tokenizers are supported)")
        tk = HFTokenizer.from_file(str(tj))
        tcfg = _read_json(d / "tokenizer_config.json")
        template = _pick_template(tcfg.get("chat_template"))
        if (d / "chat_template.jinja").is_file():  # transformers >= 4.50 saves it apart
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        model_cfg = _read_json(d / "config.json")

        def special_id(name: str) -> int | None:
            tok = _token_content(tcfg.get(name))
            tid = tk.token_to_id(tok) if tok is not None else None
            if tid is None and isinstance(model_cfg.get(f"{name}_id"), int):
                tid = model_cfg[f"{name}_id"]
            return tid

        gen_eos = _read_json(d / "generation_config.json").get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
        return cls(tk, bos_token_id=special_id("bos_token"), eos_token_id=special_id("eos_token"),
                   chat_template=template, extra_stop_ids=extra, source=d)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for `text`. Special-token strings in `text` (e.g. "<|im_start|>") map
        to their single ids; `add_special_tokens` adds the model's BOS/EOS decoration."""
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` variable itself."""
        return self._template is not None and "tools" in self._template.source

    def to_json(self) -> str:
        """The HF ``tokenizers`` JSON (what the grammar compiler builds its tokenizer from)."""
        return self._tk.to_str()

    def save_hf(self, out_dir: Path) -> None:
        """Write the tokenizer as transformers loads it: ``tokenizer.json`` and a
        ``tokenizer_config.json`` with the special tokens and chat template. For the tools
        that count tokens client-side (guidellm, aiperf, lm-eval) when the model is a GGUF."""
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "tokenizer.json").write_text(self.to_json(), encoding="utf-8")
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for name, tid in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id)):
            if tid is not None:
                cfg[name] = self._tk.id_to_token(tid)
        if self._template is not None:
            cfg["chat_template"] = self._template.source
        (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1), encoding="utf-8")

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry for `token_id` (byte-level form, e.g. "Ġhello"), or None."""
        return self._tk.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to the text, raw: a token holding part of a UTF-8
        character gives that part (its decoding alone is U+FFFD). An added or special
        token gives its text's UTF-8; an id outside the vocabulary, nothing."""
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        piece = self._tk.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_level_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        m = _BYTE_TOKEN.fullmatch(piece)
        if m is not None:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word boundary

    @functools.cached_property
    def _added(self) -> dict[int, str]:
        return {i: t.content for i, t in self._tk.get_added_tokens_decoder().items()}

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the vocabulary is byte-level BPE (GPT-2, Llama 3, SmolLM2), not
        SentencePiece's pieces with byte fallback."""
        return self._tk.decoder is not None and b'"ByteLevel"' in self._tk.decoder.__getstate__()

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render `messages` with the model's template (sandboxed); ValueError on failure."""
        if self._template is None:
            raise ChatTemplateError(f"model {self.source} has no chat template")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, **extra)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids for a chat: the rendered template, tokenized without extra decoration
        (templates write their own BOS)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))
