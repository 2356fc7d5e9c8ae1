"""A tiny random LLaVA model on disk and transformers' answer on it (the reference)."""

from __future__ import annotations

import base64
import io
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import torch
from PIL import Image

from services.encode.client import CHANNEL_OPTIONS, GrpcEncodeChannel
from services.encode.grpc_server import serve_encode_worker
from services.engine.multimodal.blocks import EmbeddingBlockAllocator
from services.engine.multimodal.buffers import EmbeddingBuffers
from services.engine.multimodal.embedder import LocalEncodeChannel, VisionEncoder
from services.engine.multimodal.image_processor import load_processor_config, preprocess
from services.engine.multimodal.tiny import make_tiny_llava
from services.engine.multimodal.transfer import EmbeddingSender
from services.model.tokenizer import Tokenizer


def image_png(color: tuple[int, int, int], size: tuple[int, int] = (30, 20)) -> bytes:
    img = Image.new("RGB", size, color)
    img.putpixel((3, 4), (255 - color[0], 0, 255))  # not flat: the crop and resize show
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def make_model(path: Path, vision: str = "clip", text: str = "llama") -> Path:
    return make_tiny_llava(path, vision, text)


def hf_greedy_text(model_dir: Path, text_before: str, pngs: list[bytes], text_after: str,
                   max_new_tokens: int) -> str:
    """transformers' greedy answer to one user message: text_before, the images, text_after."""
    import json

    from transformers import LlavaForConditionalGeneration

    tok = Tokenizer.from_path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    image_token = tok.id_to_token(cfg["image_token_index"])
    content = text_before + image_token * len(pngs) + text_after
    ids = tok.encode_chat([{"role": "user", "content": content}])
    per_image = cfg["image_seq_length"]
    full: list[int] = []
    for t in ids:
        full.extend([t] * (per_image if t == cfg["image_token_index"] else 1))
    vc = cfg["vision_config"]
    kind = "clip" if vc["model_type"].startswith("clip") else "siglip"
    pp = load_processor_config(model_dir, kind, vc["image_size"])
    pixels = torch.stack([preprocess(Image.open(io.BytesIO(p)), pp) for p in pngs])
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir).float().eval()
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([full]), pixel_values=pixels, max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return tok.decode(out[0, len(full):].tolist())


@asynccontextmanager
async def encode_server(model_dir, block_size: int = 4, num_blocks: int = 64, name: str = "encode-0",
                        channel_cls=LocalEncodeChannel):
    """A real encode worker (the vision model, seed 002's sender) on gRPC; yields its
    in-process channel (to inspect) and a gRPC channel to it."""
    encoder = VisionEncoder(model_dir)
    sender = EmbeddingSender(EmbeddingBlockAllocator(num_blocks, block_size, 1),
                             EmbeddingBuffers(num_blocks, block_size, encoder.hidden_size), encoder.encode)
    local = channel_cls(sender, name)
    server, port = await serve_encode_worker(local, "127.0.0.1", 0)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    try:
        yield local, GrpcEncodeChannel(f"127.0.0.1:{port}", ch, name), server
    finally:
        await ch.close()
        await server.stop(grace=0)
        local.close()
