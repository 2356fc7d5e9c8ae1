"""Time TorchRunner.execute on a SmolLM2-135M-shaped model with random weights.

Not a test: prints tokens/s for one long prefill and for batched decode at a few
concurrencies, each repeated (the best and the median are shown, since the machine is shared).

    PYTHONPATH=. python benchmarks/engine_forward.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.common.config import EngineConfig
from services.engine.batch import ScheduledBatch, ScheduledSeq
from services.engine.model_config import ModelArchConfig
from services.engine.request import SamplingParams
from services.engine.runner.torch_runner import TorchRunner

SMOLLM2_135M = ModelArchConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def random_hf_tensors(arch: ModelArchConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    h, hd, i = arch.hidden_size, arch.head_dim, arch.intermediate_size
    t = {"model.embed_tokens.weight": w(arch.vocab_size, h), "model.norm.weight": torch.ones(h)}
    for n in range(arch.num_layers):
        p = f"model.layers.{n}."
        t[p + "input_layernorm.weight"] = torch.ones(h)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h)
        t[p + "self_attn.q_proj.weight"] = w(arch.num_heads * hd, h)
        t[p + "self_attn.k_proj.weight"] = w(arch.num_kv_heads * hd, h)
        t[p + "self_attn.v_proj.weight"] = w(arch.num_kv_heads * hd, h)
        t[p + "self_attn.o_proj.weight"] = w(h, arch.num_heads * hd)
        t[p + "mlp.gate_proj.weight"] = w(i, h)
        t[p + "mlp.up_proj.weight"] = w(i, h)
        t[p + "mlp.down_proj.weight"] = w(h, i)
    if not arch.tie_word_embeddings:
        t["lm_head.weight"] = w(arch.vocab_size, h)
    return t


SP = SamplingParams(temperature=0.8)


def _blocks(first: int, n_tokens: int, block_size: int) -> list[int]:
    return list(range(first, first + (n_tokens + block_size - 1) // block_size))


def bench_prefill(runner: TorchRunner, n_tokens: int, repeats: int) -> list[float]:
    rates = []
    blocks = _blocks(0, n_tokens, runner.block_size)
    for r in range(repeats):
        tokens = torch.randint(0, runner.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(r)).tolist()
        batch = ScheduledBatch([ScheduledSeq("p", tokens, 0, blocks, True, SP)])
        t0 = time.perf_counter()
        runner.execute(batch)
        rates.append(n_tokens / (time.perf_counter() - t0))
    return rates


def bench_decode(runner: TorchRunner, n_seqs: int, context: int, steps: int, repeats: int) -> list[float]:
    """``steps`` decode steps of ``n_seqs`` sequences that already hold ``context`` tokens."""
    bs = runner.block_size
    per_seq = (context + steps + bs - 1) // bs
    tables = [_blocks(i * per_seq, context + steps, bs) for i in range(n_seqs)]
    rates = []
    for _ in range(repeats):
        seqs = [ScheduledSeq(f"d{i}", [1], context, tables[i], True, SP) for i in range(n_seqs)]
        runner.execute(ScheduledBatch(seqs))  # warm-up step
        t0 = time.perf_counter()
        for s in range(steps):
            for i, q in enumerate(seqs):
                q.start_pos = context + s
                q.num_generated = s
                q.token_ids = [(i * 31 + s) % runner.vocab_size]
            runner.execute(ScheduledBatch(seqs))
        rates.append(n_seqs * steps / (time.perf_counter() - t0))
    return rates


def _fmt(name: str, rates: list[float]) -> str:
    return f"{name:<28} best {max(rates):8.1f} tok/s   median {statistics.median(rates):8.1f} tok/s   ({', '.join(f'{r:.0f}' for r in rates)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefill-tokens", type=int, default=1000)
    ap.add_argument("--context", type=int, default=256, help="tokens already cached per decode seq")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    args = ap.parse_args()

    cfg = EngineConfig(
        device=args.device, dtype=args.dtype, threads=args.threads, block_size=16, num_kv_blocks=1024
    )
    runner = TorchRunner(SMOLLM2_135M, random_hf_tensors(SMOLLM2_135M), cfg, max_model_len=4096)
    print(f"device={runner.device} dtype={runner.dtype} threads={torch.get_num_threads()}")
    bench_prefill(runner, 64, 1)  # warm-up
    print(_fmt(f"prefill {args.prefill_tokens} tokens", bench_prefill(runner, args.prefill_tokens, args.repeats)))
    for n in args.concurrency:
        rates = bench_decode(runner, n, args.context, args.steps, args.repeats)
        print(_fmt(f"decode x{n} (ctx {args.context})", rates))


if __name__ == "__main__":
    main()
