"""Tokenizer from the real SmolLM2 GGUF, from a tokenizer.json directory, and from a tiny
GGUF written from that same tokenizer; chat templates rendered in the sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from services.model.tokenizer import Tokenizer

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = ["Hello world, hello tokens!", "héllo 世界 🙂", "  spaces\tand\nnewlines 12345 ", ""]


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


@pytest.mark.model
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_round_trip(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    assert all(0 <= i < smol.vocab_size for i in ids)
    assert smol.decode(ids) == text


@pytest.mark.model
def test_smollm2_specials_and_digits(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert smol.encode("<|im_start|>") == [1]
    assert smol.id_to_token(2) == "<|im_end|>"
    assert smol.eos_token_id == 2 and 2 in smol.stop_token_ids
    # SmolLM2's pre-tokenizer splits digits one by one (HF Digits(individual_digits=True)).
    assert [smol.id_to_token(i) for i in smol.encode("12345")] == list("12345")
    assert smol.decode(smol.encode("<|im_end|>hi")) == "hi"
    assert smol.decode(smol.encode("<|im_end|>hi"), skip_special_tokens=False) == "<|im_end|>hi"


@pytest.mark.model
def test_smollm2_chat_template(smol: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = smol.apply_chat_template(msgs)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not smol.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")
    ids = smol.encode_chat(msgs)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert smol.decode(ids, skip_special_tokens=False) == text
    # Without a system message the template adds its default one.
    assert smol.apply_chat_template([{"role": "user", "content": "Hi"}]).startswith("<|im_start|>system\nYou are")


def _train_bpe() -> HFTokenizer:
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(["hello world the quick brown fox jumps"] * 20 + TEXTS, trainer=trainer)
    return tk


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    _train_bpe().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": {"content": "<|endoftext|>"}, "chat_template": CHATML}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return d


def test_hf_dir_tokenizer(hf_dir: Path) -> None:
    tok = Tokenizer.from_path(hf_dir)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 0)
    assert tok.stop_token_ids == (0, 2)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    msgs = [{"role": "user", "content": "héllo"}]
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat(msgs)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1
    assert tok.decode(ids) == "user\nhéllo\nassistant\n"


def _write_tokenizer_gguf(path: Path, tk: HFTokenizer, pre: str) -> None:
    """Store `tk` the way llama.cpp's converter does: tokens by id, 'a b' merges, types."""
    vocab = tk.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = json.loads(tk.to_str())["model"]["merges"]
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(2)
    w.add_bos_token_id(1)
    w.add_add_bos_token(True)
    w.add_chat_template(CHATML)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_tokenizer_matches_tokenizer_json(hf_dir: Path, tmp_path: Path) -> None:
    _write_tokenizer_gguf(tmp_path / "t.gguf", HFTokenizer.from_file(str(hf_dir / "tokenizer.json")), "gpt-2")
    from_gguf, from_json = Tokenizer.from_path(tmp_path / "t.gguf"), Tokenizer.from_path(hf_dir)
    assert from_gguf.vocab_size == from_json.vocab_size
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>"]:
        assert from_gguf.encode(text) == from_json.encode(text)
    # add_bos_token=True in the GGUF: BOS is prepended only when asked for.
    assert from_gguf.encode("hello", add_special_tokens=True) == [1, *from_json.encode("hello")]
    assert from_gguf.stop_token_ids == (2,)


def test_unsupported_pre_tokenizer_named(hf_dir: Path, tmp_path: Path) -> None:
    _write_tokenizer_gguf(tmp_path / "t.gguf", HFTokenizer.from_file(str(hf_dir / "tokenizer.json")), "mystery")
    with pytest.raises(ValueError, match="pre-tokenizer 'mystery'"):
        Tokenizer.from_path(tmp_path / "t.gguf")


def _with_template(hf_dir: Path, tmp_path: Path, template: str) -> Tokenizer:
    for f in ("tokenizer.json", "generation_config.json"):
        (tmp_path / f).write_bytes((hf_dir / f).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return Tokenizer.from_path(tmp_path)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% set x = messages.append(1) %}{{ x }}",
])
def test_template_sandbox_blocks_escape(hf_dir: Path, tmp_path: Path, template: str) -> None:
    tok = _with_template(hf_dir, tmp_path, template)
    with pytest.raises(ValueError, match="unsafe"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_errors_are_value_errors(hf_dir: Path, tmp_path: Path) -> None:
    tok = _with_template(hf_dir, tmp_path, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="does not compile"):
        _with_template(hf_dir, tmp_path, "{% for %}")
    with pytest.raises(ValueError, match="message 0"):
        tok.apply_chat_template([{"content": "no role"}])


@pytest.mark.model
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_token_bytes_are_the_raw_bytes(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    assert b"".join(smol.token_bytes(i) for i in ids) == text.encode()


@pytest.mark.model
def test_smollm2_token_bytes_of_a_split_character_and_a_special(smol: Tokenizer) -> None:
    # "日" is three bytes over three tokens: each decodes alone to U+FFFD.
    ids = smol.encode(" 日")
    assert [smol.decode([i]) for i in ids] == [" \ufffd", "\ufffd", "\ufffd"]
    assert [smol.token_bytes(i) for i in ids] == [b" \xe6", b"\x97", b"\xa5"]
    assert smol.token_bytes(2) == b"<|im_end|>"
    assert smol.token_bytes(10**6) == b""


def test_sentencepiece_token_bytes_from_byte_fallback(tmp_path: Path) -> None:
    vocab = {"<unk>": 0, "<0xE6>": 1, "<0x97>": 2, "<0xA5>": 3, "\u2581hi": 4, "\u2581": 5}
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse()])
    tk.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_path(tmp_path)
    assert [tok.token_bytes(i) for i in range(1, 6)] == [b"\xe6", b"\x97", b"\xa5", b" hi", b" "]


def test_smollm2_saved_for_transformers_encodes_and_templates_as_we_do(smol: Tokenizer,
                                                                       tmp_path: Path) -> None:
    """`tandem model tokenizer` (save_hf): what guidellm, aiperf and lm-eval count tokens
    with must be the served tokenizer, chat template and stop tokens included."""
    from transformers import AutoTokenizer

    smol.save_hf(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "Hello, world! <|im_start|>user\nnaïve 12345 tokens\t\n"
    assert hf.encode(text, add_special_tokens=False) == smol.encode(text)
    assert hf.eos_token == "<|im_end|>" and hf.convert_tokens_to_ids(hf.eos_token) == smol.eos_token_id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        smol.apply_chat_template(messages)
    again = Tokenizer.from_path(tmp_path)  # and it serves as the model's own tokenizer too
    assert again.stop_token_ids == smol.stop_token_ids and again.encode(text) == smol.encode(text)
