"""CLIP and SigLIP vision towers and the LLaVA projector: pixels -> image embeddings.

Module and parameter names follow Hugging Face's (``embeddings.patch_embedding``,
``encoder.layers.{i}.self_attn.q_proj``, ``linear_1``...), so a checkpoint's tensors load
with one strict ``load_state_dict``. The tower runs only the encoder layers the selected
``vision_feature_layer`` needs; its final norm and SigLIP's pooling head are never used.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from services.model.llava_config import LlavaArchConfig, VisionTowerConfig


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu(x)
    return F.gelu(x, approximate="tanh")  # gelu_pytorch_tanh, gelu_new


class _Embeddings(nn.Module):
    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size, bias=not cfg.has_cls
        )
        if cfg.has_cls:
            self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size))
        self.position_embedding = nn.Embedding(cfg.num_positions, cfg.hidden_size)
        self.has_cls = cfg.has_cls

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))  # (N, D, h, w)
        x = x.flatten(2).transpose(1, 2)  # (N, P, D)
        if self.has_cls:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)  # (N, 1 + P, D)
        return x + self.position_embedding.weight


class _Attention(nn.Module):
    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, d // cfg.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = (p(x).view(n, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # (N, heads, T, hd)
        out = F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(self.head_dim))
        return self.out_proj(out.transpose(1, 2).reshape(n, t, d))


class _Mlp(nn.Module):
    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = _Attention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = _Mlp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, cfg: VisionTowerConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(cfg) for _ in range(num_layers))


class VisionTower(nn.Module):
    """pixels (N, C, S, S) -> hidden states 0..``num_layers`` (0 = the embeddings, after
    CLIP's pre-norm), each (N, positions, D)."""

    def __init__(self, cfg: VisionTowerConfig, num_layers: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = _Embeddings(cfg)
        if cfg.has_cls:
            self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = _Encoder(cfg, num_layers)

    def forward(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        x = self.embeddings(pixels)
        if self.cfg.has_cls:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return states


class Projector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(activation(self.act, self.linear_1(x)))


class ImageEncoder(nn.Module):
    """The vision half of a LLaVA model: pixels (N, C, S, S) -> embeddings
    (N, tokens_per_image, text hidden size), one row per image placeholder token."""

    def __init__(self, arch: LlavaArchConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.arch = arch
        self.vision_tower = VisionTower(arch.vision, arch.layers_to_run)
        self.multi_modal_projector = Projector(
            arch.vision.hidden_size * len(arch.feature_layers), arch.text.hidden_size,
            arch.projector_act, arch.projector_bias,
        )
        self.to(dtype=dtype, device=device)
        self.requires_grad_(False)
        self.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.multi_modal_projector.linear_1.weight.device

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        states = self.vision_tower(pixels.to(self.device))
        picked = [states[i] for i in self.arch.feature_indices]
        if self.arch.select_strategy == "default":
            picked = [s[:, 1:] for s in picked]
        return self.multi_modal_projector(torch.cat(picked, dim=-1))

    @torch.no_grad()
    def load_hf_weights(self, vision: dict[str, torch.Tensor], projector: dict[str, torch.Tensor]) -> None:
        """``vision``: tower tensors named from ``embeddings.`` down; ``projector``: ``linear_1.weight``...

        Encoder layers past ``layers_to_run`` and the unused final norm / pooling head are
        dropped; anything else missing or unexpected raises ValueError naming it."""
        keep = {}
        for name, t in vision.items():
            if name.startswith(("post_layernorm.", "head.")) or name.endswith("position_ids"):
                continue  # unused by LLaVA; position_ids: a buffer older checkpoints saved
            if name.startswith("encoder.layers."):
                if int(name.split(".")[2]) >= self.arch.layers_to_run:
                    continue
            keep[name] = t
        _strict_load(self.vision_tower, keep, "vision_tower")
        _strict_load(self.multi_modal_projector, projector, "multi_modal_projector")


def _strict_load(module: nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> None:
    want = module.state_dict()
    missing = sorted(want.keys() - tensors.keys())
    extra = sorted(tensors.keys() - want.keys())
    if missing:
        raise ValueError(f"missing tensor {prefix}.{missing[0]!r} ({len(missing)} missing in all)")
    if extra:
        raise ValueError(f"unexpected tensor {prefix}.{extra[0]!r} ({len(extra)} unexpected in all)")
    for name, dst in want.items():
        src = tensors[name]
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{prefix}.{name}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    module.load_state_dict({k: v.to(want[k].dtype) for k, v in tensors.items()})
