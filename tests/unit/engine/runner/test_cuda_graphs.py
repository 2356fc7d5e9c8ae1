"""Decode CUDA graphs (services/engine/runner/cuda_graphs.py): the buckets, the padded
forward a graph replays (checked on CPU against the eager step, KV cache included), and on
CUDA the replays themselves against eager: logits for several batch sizes and greedy
tokens through the whole engine (serial and overlapped loop, real SmolLM2 where pulled).
The CUDA tests skip without a GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from services.api.sampling import SamplingParams
from services.common.config import EngineConfig
from services.engine.batch import ScheduledBatch
from services.engine.engine import LLMEngine
from services.engine.request import GenerateRequest
from services.engine.runner.cuda_graphs import DecodeGraphs, batch_buckets, context_buckets
from services.engine.runner.torch_runner import TorchRunner
from tests.support.tiny_model import batch, seq, tiny_hf_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BS = 4


@pytest.fixture(scope="module")
def tiny():
    return tiny_hf_model("llama", seed=3)


def test_buckets() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_buckets(1) == [1]
    assert context_buckets(2048, 16) == [16, 32, 64, 128]
    assert context_buckets(2000, 16) == [16, 32, 64, 125]
    assert context_buckets(100, 16) == [7]


def _graphs_on_cpu(runner: TorchRunner, max_num_seqs: int, max_context: int, scratch_block: int) -> DecodeGraphs:
    return DecodeGraphs(runner.model, runner._kv_layers, BS, max_num_seqs, max_context,
                        scratch_slot=scratch_block * BS, device=runner.device)


def test_bucket_picks_the_smallest_fit_and_refuses_what_is_not_decode(tiny) -> None:
    hf, arch = tiny
    r = TorchRunner(arch, hf.state_dict(), EngineConfig(device="cpu", dtype="float32",
                                                        block_size=BS, num_kv_blocks=64))
    g = _graphs_on_cpu(r, 8, 128, 63)  # context buckets (blocks): 16, 32
    assert g.context_blocks == [16, 32]
    one = seq("a", [5], 3, [0])
    assert g.bucket(batch(one)) == (1, 16)
    assert g.bucket(batch(*[seq(f"s{i}", [5], 70, list(range(18))) for i in range(3)])) == (4, 32)
    assert g.bucket(batch(seq("p", [5, 6], 0, [0]))) is None  # a prefill chunk
    assert g.bucket(batch(one, seq("p", [5, 6], 0, [1]))) is None  # mixed
    assert g.bucket(batch(*[seq(f"s{i}", [5], 3, [i]) for i in range(9)])) is None  # > 8 seqs
    assert g.bucket(batch(seq("long", [5], 128, list(range(33))))) is None  # > 128 tokens
    assert g.bucket(ScheduledBatch()) is None


def _prefilled(arch, tensors, cfg: EngineConfig, prompts: list[list[int]]) -> TorchRunner:
    r = TorchRunner(arch, tensors, cfg)
    for i, p in enumerate(prompts):
        r.execute(batch(seq(f"s{i}", p, 0, _blocks(i))))
    return r


def _blocks(i: int) -> list[int]:
    return [i * 6 + j for j in range(6)]  # 24 tokens of room per sequence, disjoint


@pytest.mark.parametrize("n", [1, 3, 5])
def test_padded_forward_equals_the_eager_step_and_touches_only_its_slots(tiny, n: int) -> None:
    """What a graph replays, run eagerly on CPU: padding rows (to a batch of 8, a context of
    16 blocks) change neither the real rows' logits nor any KV block but the scratch one."""
    hf, arch = tiny
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64)
    gen = torch.Generator().manual_seed(n)
    prompts = [torch.randint(3, 128, (int(length),), generator=gen).tolist()
               for length in torch.randint(2, 15, (n,), generator=gen)]
    eager = _prefilled(arch, hf.state_dict(), cfg, prompts)
    padded = _prefilled(arch, hf.state_dict(), cfg, prompts)
    step = batch(*[seq(f"s{i}", [7 + i], len(p), _blocks(i)) for i, p in enumerate(prompts)])
    want = eager.logits_for(step)
    graphs = _graphs_on_cpu(padded, 8, 64, scratch_block=63)
    key = graphs.bucket(step)
    assert key == (8 if n > 4 else 4 if n > 2 else n, 16)
    with torch.inference_mode():
        got = graphs.padded_forward(step, key, torch.zeros(0, dtype=torch.int64))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    scratch = eager.kv_cache.shape[2] - 1
    torch.testing.assert_close(padded.kv_cache[:, :, :scratch], eager.kv_cache[:, :, :scratch],
                               atol=1e-5, rtol=1e-5)
    assert not padded.kv_cache[:, :, n * 6 : scratch].any()  # no sequence's: untouched
    # the padding rows (none at n = 1) wrote there
    assert bool(padded.kv_cache[:, :, scratch].any()) == (key[0] > n)


def test_padded_forward_resolves_placeholders_from_the_future_map(tiny) -> None:
    hf, arch = tiny
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    eager = _prefilled(arch, hf.state_dict(), cfg, prompts)
    padded = _prefilled(arch, hf.state_dict(), cfg, prompts)
    real = batch(seq("s0", [40], 3, _blocks(0)), seq("s1", [41], 5, _blocks(1)))
    placeholders = batch(seq("s0", [-1 - 2], 3, _blocks(0)), seq("s1", [41], 5, _blocks(1)))
    future = torch.tensor([0, 0, 40, 0])
    graphs = _graphs_on_cpu(padded, 4, 64, scratch_block=63)
    with torch.inference_mode():
        got = graphs.padded_forward(placeholders, graphs.bucket(placeholders), future)
    torch.testing.assert_close(got, eager.logits_for(real), atol=1e-5, rtol=1e-5)


class _EagerGraphs(DecodeGraphs):
    """Replays by running the padded forward: the runner's graph path (bucketing, sampled
    rows, placeholders) through a whole engine on CPU."""

    def run(self, batch: ScheduledBatch, key: tuple[int, int], future: torch.Tensor) -> torch.Tensor:
        self.replays += 1
        return self.padded_forward(batch, key, future)


@pytest.mark.parametrize("overlap", [False, True])
def test_runner_graph_path_gives_the_eager_greedy_tokens(tiny, overlap: bool) -> None:
    hf, arch = tiny
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (int(length),), generator=gen).tolist()
               for length in torch.randint(2, 20, (7,), generator=gen)]
    blocks = 64
    out = {}
    for graphs in (False, True):
        cfg = EngineConfig(device="cpu", dtype="float32", block_size=BS, num_kv_blocks=blocks + 1,
                           max_num_seqs=6, max_num_batched_tokens=32, overlap=overlap)
        runner = TorchRunner(arch, hf.state_dict(), cfg)
        # the last block is the scratch one, as the runner sets it up on CUDA
        runner.kv_spec = dataclasses.replace(runner.kv_spec, num_blocks=blocks)
        if graphs:
            runner.graphs = _EagerGraphs(runner.model, runner._kv_layers, BS, 6, 96,
                                         scratch_slot=blocks * BS, device=runner.device)
        out[graphs] = _greedy(LLMEngine(runner, cfg, eos_token_ids=[0]), prompts, 24)
        if graphs:
            assert runner.graphs.replays > 0
    assert out[True] == out[False]


def test_cuda_graphs_true_on_cpu_is_an_error(tiny) -> None:
    hf, arch = tiny
    with pytest.raises(ValueError, match="engine.cuda_graphs"):
        TorchRunner(arch, hf.state_dict(), EngineConfig(device="cpu", cuda_graphs=True))
    r = TorchRunner(arch, hf.state_dict(), EngineConfig(device="cpu", num_kv_blocks=8))
    assert r.graphs is None and r.kv_cache.shape[2] == 8  # auto: off on CPU, no scratch block


# ---- CUDA: the replays -------------------------------------------------------------------

def _cuda_cfg(graphs: bool, dtype: str = "float32", **kw: object) -> EngineConfig:
    base = dict(device="cuda", dtype=dtype, block_size=BS, num_kv_blocks=96, max_num_seqs=16,
                max_num_batched_tokens=64, cuda_graphs=graphs, cuda_graph_max_context=128)
    return EngineConfig(**{**base, **kw})


# float32: equal to rounding; bfloat16: a padded batch may take other GEMM kernels, so
# within bfloat16's precision (a wrong slot, mask or position is off by whole units)
_TOL = {"float32": {"atol": 1e-4, "rtol": 1e-4}, "bfloat16": {"atol": 0.1, "rtol": 0.05}}


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 16])
def test_replay_logits_equal_eager(tiny, n: int, dtype: str) -> None:
    hf, arch = tiny
    gen = torch.Generator().manual_seed(n)
    prompts = [torch.randint(3, 128, (int(length),), generator=gen).tolist()
               for length in torch.randint(2, 15, (n,), generator=gen)]
    eager = _prefilled(arch, hf.state_dict(), _cuda_cfg(False, dtype), prompts)
    graphed = _prefilled(arch, hf.state_dict(), _cuda_cfg(True, dtype), prompts)
    assert eager.graphs is None and graphed.graphs is not None
    assert graphed.graphs.num_graphs == len(batch_buckets(16)) * len(context_buckets(128, BS))
    for step_i in range(3):  # three decode steps: the replays read the KV they wrote
        step = batch(*[seq(f"s{i}", [7 + i + step_i], len(p) + step_i, _blocks(i))
                       for i, p in enumerate(prompts)])
        before = graphed.graphs.replays
        got, want = graphed.logits_for(step), eager.logits_for(step)
        assert graphed.graphs.replays == before + 1
        torch.testing.assert_close(got, want, **_TOL[dtype])
    torch.testing.assert_close(graphed.kv_cache[:, :, :96].float(), eager.kv_cache[:, :, :96].float(),
                               **_TOL[dtype])


def _greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", p, sp))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    engine.check_integrity()
    return got


@needs_cuda
@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_tokens_equal_eager(tiny, overlap: bool) -> None:
    """float32, where padding changes nothing but rounding (bfloat16 could flip a near
    tie of the random model's logits; its replays are checked by the logits test)."""
    hf, arch = tiny
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (int(length),), generator=gen).tolist()
               for length in torch.randint(2, 30, (11,), generator=gen)]
    out = {}
    for graphs in (False, True):
        cfg = _cuda_cfg(graphs, "float32", overlap=overlap)
        runner = TorchRunner(arch, hf.state_dict(), cfg)
        out[graphs] = _greedy(LLMEngine(runner, cfg, eos_token_ids=[0]), prompts, 40)
        if graphs:
            assert runner.graphs is not None and runner.graphs.replays > 0
    assert out[True] == out[False]


@needs_cuda
def test_smollm2_greedy_text_equals_eager(smollm2_path: Path) -> None:
    from services.engine.weights import load_weights
    from services.model.tokenizer import Tokenizer

    loaded = load_weights(smollm2_path)
    tok = Tokenizer.from_path(smollm2_path)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
             "The three primary colors are"]
    prompts = [tok.encode(t) for t in texts]
    out = {}
    for graphs in (False, True):
        cfg = EngineConfig(device="cuda", dtype="float32", block_size=16, num_kv_blocks=256,
                           max_num_seqs=8, cuda_graphs=graphs, cuda_graph_max_context=512)
        runner = TorchRunner(loaded.arch, loaded.tensors, cfg, 512)
        out[graphs] = _greedy(LLMEngine(runner, cfg, eos_token_ids=[]), prompts, 48)
    assert out[True] == out[False]
    assert all(len(v) == 48 for v in out[True].values())


@needs_cuda
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_smollm2_quantized_replays_equal_eager(smollm2_path: Path, quantization: str) -> None:
    """The default CUDA path for the 4-bit GGUF (bfloat16, int4 linears) and int8: graph
    replays of decode steps at several batch sizes against the eager step."""
    from services.engine.weights import load_weights

    loaded = load_weights(smollm2_path)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1000, 30000, (int(length),), generator=gen).tolist()
               for length in torch.randint(4, 40, (20,), generator=gen)]
    runners = {}
    for graphs in (False, True):
        cfg = EngineConfig(device="cuda", dtype="bfloat16", quantization=quantization,
                           block_size=16, num_kv_blocks=64, max_num_seqs=32, cuda_graphs=graphs,
                           cuda_graph_max_context=256)
        runners[graphs] = TorchRunner(loaded.arch, loaded.tensors, cfg, 256, loaded.quant)
        assert runners[graphs].quantization == quantization
    for n in (1, 5, 20):
        for r in runners.values():
            for i, p in enumerate(prompts[:n]):
                r.execute(batch(seq(f"s{i}", p, 0, [3 * i, 3 * i + 1, 3 * i + 2])))
        step = batch(*[seq(f"s{i}", [2000 + i], len(p), [3 * i, 3 * i + 1, 3 * i + 2])
                       for i, p in enumerate(prompts[:n])])
        replays = runners[True].graphs.replays
        got, want = runners[True].logits_for(step), runners[False].logits_for(step)
        assert runners[True].graphs.replays == replays + 1
        torch.testing.assert_close(got, want, atol=0.25, rtol=0.02)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_smollm2_int4_padded_forward_equals_eager_on_cpu(smollm2_path: Path) -> None:
    """The same with int4 linears on CPU, the padded forward standing in for the replay:
    padding to a bucket changes nothing but rounding through the quantized kernels."""
    from services.engine.weights import load_weights

    loaded = load_weights(smollm2_path)
    prompts = [[1000 + 7 * i + j for j in range(5 + 3 * i)] for i in range(3)]
    # the eager forward on both sides (our CPU kernels' decode path is not the one padded)
    cfg = EngineConfig(device="cpu", dtype="bfloat16", quantization="int4", block_size=16,
                       num_kv_blocks=9, max_num_seqs=4, cpu_kernels=False)
    runners = [TorchRunner(loaded.arch, loaded.tensors, cfg, 128, loaded.quant) for _ in range(2)]
    assert runners[0].quantization == "int4"
    for r in runners:
        for i, p in enumerate(prompts):
            r.execute(batch(seq(f"s{i}", p, 0, [2 * i, 2 * i + 1])))
    step = batch(*[seq(f"s{i}", [2000 + i], len(p), [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)])
    graphs = DecodeGraphs(runners[1].model, runners[1]._kv_layers, 16, 4, 128,
                          scratch_slot=8 * 16, device=runners[1].device)
    assert graphs.bucket(step) == (4, 8)
    with torch.inference_mode():
        got = graphs.padded_forward(step, (4, 8), torch.zeros(0, dtype=torch.int64)).float()
    want = runners[0].logits_for(step)
    torch.testing.assert_close(got, want, atol=0.25, rtol=0.02)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
