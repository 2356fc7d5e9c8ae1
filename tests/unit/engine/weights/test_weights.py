"""load_weights on HF directories and GGUF files built from the same tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from services.engine.weights import load_weights
from services.engine.weights.gguf_loader import unpermute_rotary
from services.model.errors import UnsupportedModelError
from tests.support.tiny_checkpoints import TINY, llama_cpp_permute, make_hf_model, write_gguf

Q = GGMLQuantizationType


@pytest.fixture(scope="module", params=[("llama", False), ("llama", True), ("qwen2", True), ("qwen2", False)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def hf_model(request, tmp_path_factory) -> tuple[str, bool, Path, dict[str, torch.Tensor]]:
    arch, tied = request.param
    d = tmp_path_factory.mktemp(f"{arch}{int(tied)}")
    return arch, tied, d, make_hf_model(d, arch, tied)


def _assert_arch(lw, arch: str, tied: bool) -> None:
    a = lw.arch
    assert a.architecture == arch
    assert (a.hidden_size, a.intermediate_size, a.num_layers) == (256, 512, 2)
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.vocab_size) == (4, 2, 64, 128)
    assert a.rope_theta == 50000.0 and a.rms_norm_eps == 1e-6
    assert a.max_position_embeddings == 512
    assert a.tie_word_embeddings is tied
    assert a.attention_bias is (arch == "qwen2")


def test_hf_dir_tensors_equal_state_dict(hf_model) -> None:
    arch, tied, d, state = hf_model
    lw = load_weights(d)
    _assert_arch(lw, arch, tied)
    assert lw.tensors.keys() == state.keys()
    assert ("lm_head.weight" in lw.tensors) is (not tied)
    for name, t in state.items():
        assert lw.tensors[name].dtype == torch.float32
        assert torch.equal(lw.tensors[name], t), name


def test_gguf_f32_equals_hf_exactly(hf_model, tmp_path: Path) -> None:
    arch, tied, d, state = hf_model
    write_gguf(tmp_path / "m.gguf", arch, state, Q.F32)
    lw = load_weights(tmp_path / "m.gguf")
    assert lw.arch == load_weights(d).arch  # every metadata field round-trips
    assert lw.tensors.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(lw.tensors[name], t), name


# Relative RMS error bounds: quantization noise of each format on Gaussian weights, far
# below the ~1.4 a misplaced row (e.g. a missing un-permute) would give.
_TOL = {Q.F16: 1e-3, Q.BF16: 5e-3, Q.Q8_0: 0.01, Q.Q6_K: 0.04, Q.Q4_0: 0.15, Q.Q4_1: 0.12, Q.Q4_K: 0.12}


@pytest.mark.parametrize("qtype", list(_TOL), ids=lambda q: q.name)
def test_gguf_quantized_close_to_hf(qtype: GGMLQuantizationType, tmp_path: Path) -> None:
    state = make_hf_model(tmp_path / "hf", "llama", tied=False, seed=1)
    write_gguf(tmp_path / "m.gguf", "llama", state, qtype)
    stored = {t.tensor_type for t in GGUFReader(tmp_path / "m.gguf").tensors}
    assert stored == {qtype, Q.F32}
    lw = load_weights(tmp_path / "m.gguf")
    for name, ref in state.items():
        got = lw.tensors[name]
        assert got.shape == ref.shape and got.dtype == torch.float32
        if ref.ndim == 1:  # norms stay F32
            assert torch.equal(got, ref), name
        else:
            rel = (torch.linalg.norm(got - ref) / torch.linalg.norm(ref)).item()
            assert rel < _TOL[qtype], f"{name}: relative error {rel:.4f}"


def test_gguf_qwen2_biases_not_permuted(tmp_path: Path) -> None:
    state = make_hf_model(tmp_path / "hf", "qwen2", tied=True, seed=2)
    write_gguf(tmp_path / "m.gguf", "qwen2", state, Q.Q8_0)
    lw = load_weights(tmp_path / "m.gguf")
    for name in ("model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.bias"):
        assert torch.equal(lw.tensors[name], state[name])
    rel = torch.linalg.norm(lw.tensors["model.layers.0.self_attn.q_proj.weight"] - state["model.layers.0.self_attn.q_proj.weight"])
    assert rel / torch.linalg.norm(state["model.layers.0.self_attn.q_proj.weight"]) < 0.01


@pytest.mark.parametrize("n_head,head_dim,cols", [(4, 64, 8), (3, 2, 1), (9, 64, 0)])
def test_unpermute_inverts_llama_cpp_permute(n_head: int, head_dim: int, cols: int) -> None:
    shape = (n_head * head_dim, cols) if cols else (n_head * head_dim,)
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    back = unpermute_rotary(torch.from_numpy(llama_cpp_permute(w, n_head)), n_head)
    assert torch.equal(back, torch.from_numpy(w))


def test_hf_sharded_checkpoint(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="1MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    lw = load_weights(tmp_path)
    for name, t in model.state_dict().items():
        assert torch.equal(lw.tensors[name], t), name


def test_hf_unsupported_architecture_named(hf_model, tmp_path: Path) -> None:
    _, _, d, _ = hf_model
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"'GPT2LMHeadModel' in .*config.json is not supported; supported: LlamaForCausalLM"):
        load_weights(tmp_path)


def test_hf_missing_weights_named(hf_model, tmp_path: Path) -> None:
    _, _, d, _ = hf_model
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        load_weights(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_weights(tmp_path / "nope")


def test_gguf_unsupported_architecture_named(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2' .* supported: llama, qwen2"):
        load_weights(tmp_path / "g.gguf")


def _dequant_q4_1(raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Independent Q4_1: 20-byte blocks of (d fp16, m fp16, 16 bytes); low nibbles are
    values 0-15, high nibbles 16-31; value = d * q + m."""
    b = raw.reshape(-1, 20)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = b[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(shape)


def _dequant_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Independent Q8_0: 34-byte blocks of (d fp16, 32 int8); value = d * q."""
    b = raw.reshape(-1, 34)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    return (d * b[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(shape)


@pytest.mark.model
def test_real_smollm2_gguf(smollm2_path: Path) -> None:
    lw = load_weights(smollm2_path)
    a = lw.arch
    assert (a.architecture, a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads) == ("llama", 576, 30, 9, 3)
    assert (a.head_dim, a.intermediate_size, a.vocab_size) == (64, 1536, 49152)
    assert a.tie_word_embeddings and "lm_head.weight" not in lw.tensors
    assert a.rope_theta == 100000.0 and a.rms_norm_eps == 1e-5 and a.max_position_embeddings == 8192
    raw = {t.name: t for t in GGUFReader(smollm2_path).tensors}
    assert raw["blk.3.attn_v.weight"].tensor_type == Q.Q4_1
    assert raw["token_embd.weight"].tensor_type == Q.Q8_0
    v = _dequant_q4_1(np.asarray(raw["blk.3.attn_v.weight"].data), (192, 576))
    assert torch.equal(lw.tensors["model.layers.3.self_attn.v_proj.weight"], torch.from_numpy(v))
    q = _dequant_q4_1(np.asarray(raw["blk.3.attn_q.weight"].data), (576, 576))
    assert torch.equal(torch.from_numpy(llama_cpp_permute(lw.tensors["model.layers.3.self_attn.q_proj.weight"].numpy(), 9)),
                       torch.from_numpy(q))
    e = _dequant_q8_0(np.asarray(raw["token_embd.weight"].data), (49152, 576))
    assert torch.equal(lw.tensors["model.embed_tokens.weight"], torch.from_numpy(e))
