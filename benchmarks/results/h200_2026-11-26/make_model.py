"""Write a SmolLM2-135M-shaped Llama with RANDOM weights as an HF directory the engine loads
(config.json, model.safetensors in bfloat16, the real SmolLM2 tokenizer carried beside this
script). Step time does not depend on weight values; the outputs are noise.

usage: make_model.py OUT_DIR [--tiny]   (--tiny: 2 layers, for a CPU dry run)"""
import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

out = Path(sys.argv[1])
tiny = "--tiny" in sys.argv
# SmolLM2-135M-Instruct's GGUF metadata: llama.* keys, tokenizer.ggml.{bos,eos}_token_id
cfg = LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=2 if tiny else 30, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    torch_dtype="bfloat16",
)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
here = Path(__file__).parent
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(here / name, out / name)
(out / "README.txt").write_text("SmolLM2-135M shape, RANDOM weights: for step timing only.\n")
print(f"wrote {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)")
