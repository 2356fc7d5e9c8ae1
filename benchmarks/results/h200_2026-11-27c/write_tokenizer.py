"""Write tokenizer.json / tokenizer_config.json for make_model.py (../h200_2026-11-26/) from
the SmolLM2 GGUF's own tokenizer, so the random-weight model tokenizes as the real one.

usage: write_tokenizer.py GGUF OUT_DIR"""
import json
import sys
from pathlib import Path

from services.model.tokenizer_gguf import load_gguf_tokenizer

gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
d = load_gguf_tokenizer(gguf)
d.tokenizer.save(str(out / "tokenizer.json"))
vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
name = {v: k for k, v in vocab.items()}
(out / "tokenizer_config.json").write_text(json.dumps({
    "bos_token": name.get(d.bos_token_id), "eos_token": name.get(d.eos_token_id),
    "chat_template": d.chat_template, "model_max_length": 8192}))
