"""The torch model runner: owns the model and the paged KV cache, executes scheduled batches."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from services.api.outputs import TokenLogprob
from services.common.config import EngineConfig
from services.engine import huge_pages
from services.engine.batch import PendingOutput, RunnerOutput, ScheduledBatch, ScheduledSeq
from services.engine.cpu_kernels import build as cpu_build
from services.engine.cpu_kernels import isa as cpu_isa
from services.engine.cpu_kernels.cpu_features import cpu_has_fast_bf16, cpuinfo_flags
from services.engine.cpu_kernels.isa import KernelSet
from services.engine.model import LlamaModel
from services.engine.parallel.shard import TpShard
from services.engine.quant.apply import quantize_model, resolve_quantization
from services.engine.quant.groups import QuantSource
from services.engine.quant.linear import Int4Matmul
from services.engine.runner.base import KvSpec, ModelRunner, RunnerInfo
from services.engine.runner.cpu_decode import ONE_CALL_PREFILL_TOKENS, ROWS_PREFILL_SETS, CpuDecode
from services.engine.runner.step_inputs import build_step_inputs, validate_batch
from services.engine.sampler import Sampled, Sampler, prompt_token_logprobs
from services.model.arch import ModelArchConfig

if TYPE_CHECKING:
    from services.engine.runner.cuda_graphs import DecodeGraphs

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; anything else is passed to torch.device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"engine.device: invalid device {name!r}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"engine.device: {name!r} requested but CUDA is not available")
    return device


def cpu_bf16_native(cpu_isa_setting: str = "auto") -> bool:
    """Whether this CPU runs bfloat16 matmuls natively, as the engine should see it: a
    forced ``engine.cpu_isa`` without bfloat16 stands in for a CPU without it."""
    return cpu_has_fast_bf16() and not cpu_isa.stands_in_without_bf16(cpu_isa_setting)


def resolve_dtype(name: str, device: torch.device, four_bit: bool = False,
                  cpu_isa_setting: str = "auto") -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, on CPUs with native bfloat16 (AVX512-BF16, AMX) and
    for a ``four_bit`` model (a 4-bit GGUF that stays int4: its linears run on the int4
    kernels, which take bfloat16, so it never inflates to dense float32); float32 on other
    CPUs (bfloat16 dense matmuls are emulated, slower than float32, there)."""
    if name == "auto":
        fast_bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_bf16_native(cpu_isa_setting))
        return torch.bfloat16 if fast_bf16 or four_bit else torch.float32
    return _DTYPES[name]


def resolve_dense_above_rows(setting: int | None | str, device: torch.device, dtype: torch.dtype,
                             cpu_isa_setting: str = "auto") -> int | None:
    """``engine.quantized_max_rows`` -> the row count above which quantized linears use a
    dense copy (None: never). ``auto`` is 16, but None for bfloat16 on a CPU without native
    bfloat16 (``cpu_bf16_native``: a forced set without it counts as such a CPU): there the
    dense GEMM is emulated and the int8 kernels win at every size (docs/engine.md, "Dtype
    and quantized weights")."""
    if setting != "auto":
        return setting  # type: ignore[return-value]
    emulated_bf16 = device.type == "cpu" and dtype == torch.bfloat16 and not cpu_bf16_native(cpu_isa_setting)
    return None if emulated_bf16 else 16


def stays_four_bit(cfg: EngineConfig, source: QuantSource) -> bool:
    """Whether a 4-bit weights file keeps its int4 weights under ``engine.quantization``
    (int4; auto without tensor parallelism, quant/apply.py)."""
    return source.four_bit and (cfg.quantization == "int4"
                                or (cfg.quantization == "auto" and cfg.tensor_parallel_size == 1))


# A batch's prompt logprobs (RunnerOutput.prompt_logprobs), on the host; None: no row asked.
PromptLogprobs = list[list[TokenLogprob] | None] | None


class StepForward(NamedTuple):
    """One step's forward: the batch index and sequence of each sampled row, their logits
    (N, V) (None when nothing is sampled) and the batch's prompt logprobs."""

    sample_index: list[int]
    sample_seqs: list[ScheduledSeq]
    logits: torch.Tensor | None
    prompt_logprobs: PromptLogprobs = None


# What the forward thread hands back for one batch: the batch index of each sampled row,
# the sampling sequences, the draw (on the host, or being copied there), the event that
# copy completes on (CUDA), timing events bracketing the batch's device work (CUDA), and
# the prompt logprobs.
_Launched = tuple[list[int], list[ScheduledSeq], Sampled | None, "torch.cuda.Event | None",
                  "tuple[torch.cuda.Event, torch.cuda.Event] | None", PromptLogprobs]


# NOTE: cuDNN's fused attention, torch's first choice on Hopper, builds an execution plan
# for each new input shape (~40 ms on an H200), and a prefill's shape is its prompt's
# length: steps with prefill tokens run on flash / memory-efficient attention instead
# (docs/benchmarks.md "On an H200"). Pure decode keeps cuDNN: its graphs fix the shapes.
PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _runner_output(n: int, index: list[int], seqs: list[ScheduledSeq],
                   host: Sampled | None, prompt_lps: PromptLogprobs = None) -> RunnerOutput:
    """The batch's RunnerOutput from the host copy of its draw (rows ``index``)."""
    sampled: list[int | None] = [None] * n
    if host is None:
        return RunnerOutput(sampled, prompt_logprobs=prompt_lps)
    for i, tok in zip(index, host.tokens.tolist(), strict=True):
        sampled[i] = tok
    lps = host.token_logprobs(seqs)
    if lps is None:
        return RunnerOutput(sampled, prompt_logprobs=prompt_lps)
    logprobs: list[TokenLogprob | None] = [None] * n
    for i, lp in zip(index, lps, strict=True):
        logprobs[i] = lp
    return RunnerOutput(sampled, logprobs, prompt_lps)


class _TorchPending:
    """A launched batch; ``result()`` is the overlapped loop's one host sync."""

    __slots__ = ("_runner", "_future", "_n", "_out")

    def __init__(self, runner: TorchRunner, future: Future[_Launched], n: int) -> None:
        self._runner, self._future, self._n = runner, future, n
        self._out: RunnerOutput | None = None

    def wait(self) -> None:
        self.result()

    def result(self) -> RunnerOutput:
        if self._out is None:
            # re-raises a forward error
            index, seqs, host, done, timing, prompt_lps = self._future.result()
            if done is not None:
                done.synchronize()
            if timing is not None:
                self._runner.busy_seconds += timing[0].elapsed_time(timing[1]) / 1e3
            self._out = _runner_output(self._n, index, seqs, host, prompt_lps)
        return self._out


def _kernel_weights_on_huge_pages(model: torch.nn.Module) -> int:
    """Every packed weight the CPU kernels read (each Int4Matmul on them, lm_head included)
    copied onto huge pages (huge_pages.py), in one mapping; returns its bytes."""
    mats = [m for m in model.modules() if isinstance(m, Int4Matmul) and m.kernels is not None]
    moved = huge_pages.copy_to_huge_pages([t for m in mats for t in (m.codes, m.scale_min)])
    for i, m in enumerate(mats):
        m.codes, m.scale_min = moved[2 * i], moved[2 * i + 1]
    return sum(t.numel() * t.element_size() for t in moved)


def _cpu_kernels(cfg: EngineConfig, device: torch.device, dtype: torch.dtype, isa: str) -> KernelSet | None:
    """``engine.cpu_kernels`` for an int4 model, on ``isa``'s build: auto -> where they can
    run; true -> they must (ValueError naming why not)."""
    if cfg.cpu_kernels is False:
        return None
    dtypes = (torch.bfloat16,) if isa == "avx512_bf16" else (torch.bfloat16, torch.float32)
    why = None
    if isa == "none":
        why = "engine.cpu_isa resolved to none (torch's kernels only)"
    elif device.type != "cpu" or dtype not in dtypes:
        why = f"{isa}'s run on CPU in {' or '.join(map(str, dtypes))}, not {device}, {dtype}"
    if cfg.cpu_kernels is True:
        if why is None:
            try:
                return cpu_build.load(isa)
            except cpu_build.KernelUnavailable as e:
                why = str(e)
        raise ValueError(f"engine.cpu_kernels: true, but {why}")
    return cpu_build.load(isa) if why is None and cpu_build.available(isa) else None


def _prefill_tokens(batch: ScheduledBatch) -> int:
    """The step's prefill tokens: those of every sequence with more than one new token."""
    return sum(len(s.token_ids) for s in batch.seqs if len(s.token_ids) > 1)


class TorchRunner(ModelRunner):
    """Runs a LlamaModel over a KV cache ``(layers, 2, num_kv_blocks, block_size, kv_heads, head_dim)``.

    ``tensors`` are Hugging Face-named weights (see ``LlamaModel.load_hf_weights``); they
    are copied, so the caller may drop them afterwards. ``quant_source`` is what the weights
    file offers ``engine.quantization`` (exact int4 groups of GGUF blocks), if anything.

    With ``tp`` (tensor parallelism) it holds that rank's slice of the model and of the KV
    cache; ``kv_spec`` stays the whole model's layout and ``export_kv``/``import_kv`` move
    this rank's KV heads only (tp/runner.py gathers and scatters them).
    """

    supports_overlap = True
    prefill_rows = False  # every prefill step on the one-call kernel (engine.cpu_prefill)
    supports_grammar = True

    def __init__(
        self,
        arch: ModelArchConfig,
        tensors: dict[str, torch.Tensor],
        cfg: EngineConfig,
        max_model_len: int | None = None,
        quant_source: QuantSource | None = None,
        tp: TpShard | None = None,
    ) -> None:
        self.tp = tp or TpShard()
        self.device = resolve_device(cfg.device)
        source = quant_source or QuantSource()
        # NOTE: a forced set the CPU lacks fails here, at start-up, naming the missing flags.
        isa = cpu_isa.resolve(cfg.cpu_isa, cpuinfo_flags()) if self.device.type == "cpu" else "none"
        self.dtype = resolve_dtype(cfg.dtype, self.device, stays_four_bit(cfg, source), cfg.cpu_isa)
        # NOTE: on CPU the eager forward's threads already take every core: a scheduler
        # thread beside them competes instead of overlapping (measured 0.78-0.97x).
        self.overlap_pays = self.device.type == "cuda"
        self.pins_host_memory = self.device.type == "cuda"
        # SDPA backends of steps with prefill tokens (None: torch's own choice)
        self.prefill_attention = PREFILL_SDPA_BACKENDS if self.device.type == "cuda" else None
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.threads)
        self.max_model_len = max_model_len or cfg.max_model_len or arch.max_position_embeddings
        self.vocab_size = arch.vocab_size
        self.block_size = cfg.block_size
        self.kv_spec = KvSpec(
            num_layers=arch.num_layers,
            num_blocks=cfg.num_kv_blocks,
            block_size=cfg.block_size,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            dtype=self.dtype,
        )
        self.local_kv_spec = replace(self.kv_spec, num_kv_heads=self.tp.local_kv_heads(arch.num_kv_heads))
        # NOTE: a graph would capture the TP collectives of rank 0 alone: off under TP.
        if cfg.cuda_graphs is True and (self.device.type != "cuda" or self.tp.size > 1):
            raise ValueError(f"engine.cuda_graphs: true needs a CUDA device and no tensor "
                             f"parallelism, not {self.device} with TP={self.tp.size}")
        use_graphs = self.device.type == "cuda" and self.tp.size == 1 and cfg.cuda_graphs is not False
        with torch.inference_mode():
            self.model = LlamaModel(arch, self.dtype, self.device, self.tp.rank, self.tp.size,
                                    max_len=self.max_model_len)
            self.model.load_hf_weights(tensors)
            # NOTE: the batch-invariant CUDA kernels take dense weights: a 4-bit file is dequantized.
            invariant_cuda = cfg.deterministic and self.device.type == "cuda"
            self.quantization = ("none" if invariant_cuda and cfg.quantization == "auto"
                                 else resolve_quantization(cfg, self.dtype, source))
            if invariant_cuda and (self.quantization != "none" or self.tp.size > 1):
                raise ValueError(
                    "engine.deterministic: true on CUDA runs dense weights on its batch-invariant kernels "
                    f"without tensor parallelism, not quantization {self.quantization} with TP={self.tp.size}")
            kernels = (_cpu_kernels(cfg, self.device, self.dtype, isa)
                       if self.quantization == "int4" else None)
            if self.quantization != "none":
                # NOTE: a dense copy above some row count would give the sampled rows' logits
                # (lm_head) other bits in a large batch than alone: never in deterministic mode.
                dense_above = (None if cfg.deterministic
                               else resolve_dense_above_rows(cfg.quantized_max_rows, self.device, self.dtype,
                                                             cfg.cpu_isa))
                quantize_model(self.model, tensors, source, self.quantization, dense_above, kernels=kernels)
            if kernels is not None and cfg.cpu_huge_pages and huge_pages.available():
                moved = _kernel_weights_on_huge_pages(self.model)
                log.info("engine: %.0f MB of kernel weights on huge pages (this process: %.0f MB on huge "
                         "pages)", moved / 1e6, huge_pages.huge_page_bytes() / 1e6)
            # the instruction set whose kernels run (none: torch's), logged once and a metric label
            self.info = RunnerInfo(str(self.device), str(self.dtype).removeprefix("torch."), self.quantization,
                                   kernels.isa if kernels is not None else "none")
            log.info("engine: %s, %s, quantization %s, CPU kernels %s (engine.cpu_isa %s)", self.device,
                     self.dtype, self.quantization, self.info.cpu_isa, cfg.cpu_isa)
            self.deterministic = cfg.deterministic
            # NOTE: the one-call step has no all-reduce: each rank's linears run on the kernels
            # under tensor parallelism, the step itself in torch.
            one_call = kernels is not None and self.tp.size == 1 and CpuDecode.supports(self.model)
            if invariant_cuda:
                try:
                    from services.engine.layers.invariant import make_batch_invariant
                except ImportError as e:  # torch's CUDA wheels for Linux bring Triton; others may not
                    raise ValueError(f"engine.deterministic: true on CUDA needs Triton ({e})") from e
                make_batch_invariant(self.model)
            elif cfg.deterministic and not one_call:
                raise ValueError(
                    "engine.deterministic: true runs every step on the CPU int4 kernels' one-call step "
                    "(or, on CUDA, on batch-invariant kernels), "
                    f"which cannot run here ({self.device}, {self.dtype}, quantization {self.quantization}, "
                    f"CPU kernels {kernels.isa if kernels is not None else 'none'}, TP={self.tp.size})")
            if cfg.cpu_prefill == "rows" and not one_call:
                raise ValueError(
                    "engine.cpu_prefill: rows runs prefill on the CPU int4 kernels' one-call step, which "
                    f"cannot run here ({self.device}, quantization {self.quantization}, CPU kernels "
                    f"{kernels.isa if kernels is not None else 'none'}, TP={self.tp.size})")
            # Prefill of any size as rows where that path is the faster one (ROWS_PREFILL_SETS).
            self.prefill_rows = one_call and (cfg.cpu_prefill == "rows" or (
                cfg.cpu_prefill == "auto" and kernels is not None and kernels.isa in ROWS_PREFILL_SETS))
            if one_call:
                log.info("engine: prefill on the %s (engine.cpu_prefill %s)",
                         "one-call rows" if self.prefill_rows else "eager forward", cfg.cpu_prefill)
                self.model.cpu_decode = CpuDecode(self.model, cfg.block_size)
                # NOTE: a decode step in one C++ call holds no GIL and leaves a core's worth of
                # gaps, so scheduling beside it pays (bench engine: 1.13x at 32 sequences,
                # 0.96x at 1; docs/benchmarks.md "Overlap scheduler").
                self.overlap_pays = True
            self.model.eval()
            # NOTE: with CUDA graphs, one block past the pool's: the padding rows' K/V go there.
            self.kv_cache = torch.zeros(
                self.local_kv_spec.block_range_shape(cfg.num_kv_blocks + use_graphs), dtype=self.dtype,
                device=self.device,
            )
        self._kv_layers = list(self.kv_cache)  # (2, blocks, block_size, kv_heads, hd) per layer
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            from services.engine.runner.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(
                self.model, self._kv_layers, cfg.block_size, cfg.max_num_seqs,
                min(cfg.cuda_graph_max_context, self.max_model_len),
                scratch_slot=cfg.num_kv_blocks * cfg.block_size, device=self.device,
                per_token=cfg.deterministic,
            )
            t0 = time.perf_counter()
            self.graphs.capture(progress=log.info)
            log.info("decode CUDA graphs: %d captured in %.1fs", self.graphs.num_graphs,
                     time.perf_counter() - t0)
        self.sampler = Sampler(cfg.seed, self.device, row_invariant=invariant_cuda)
        # Overlap: the future-token map (device), the forward thread and, on CUDA, its
        # stream; made by reserve_future_slots / the first launch.
        self._future = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._thread: ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None

    # -- execution -------------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        if not batch.seqs:
            return RunnerOutput([])
        t0 = time.perf_counter()
        with torch.inference_mode():
            fwd = self._forward(batch)
            host = None
            if fwd.logits is not None:
                host = self.sampler.sample_tensor(fwd.logits, fwd.sample_seqs,
                                                  mask=batch.grammar_mask).to_host()
        self.busy_seconds += time.perf_counter() - t0
        return _runner_output(len(batch.seqs), fwd.sample_index, fwd.sample_seqs, host,
                              fwd.prompt_logprobs)

    def reserve_future_slots(self, n: int) -> None:
        self._future = torch.zeros(n, dtype=torch.int64, device=self.device)

    def future_slots(self, base: int, count: int) -> torch.Tensor:
        """Future-token slots ``base .. base + count``, a view of the map (tensor-parallel
        ranks fill theirs from rank 0's)."""
        return self._future[base : base + count]

    def launch(self, batch: ScheduledBatch) -> PendingOutput:
        """Queue ``batch`` on the forward thread (batches run in launch order) and return.

        On CPU the thread is what overlaps (torch releases the GIL inside its ops); on
        CUDA it also launches on its own stream, after an event that orders it behind
        the scheduler thread's earlier work (a remote-prefill import)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="engine-forward")
            if self.device.type == "cuda":
                self._stream = torch.cuda.Stream(self.device)
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record()
        return _TorchPending(self, self._thread.submit(self._run_launched, batch, ready),
                             len(batch.seqs))

    def _run_launched(self, batch: ScheduledBatch, ready: torch.cuda.Event | None) -> _Launched:
        """The forward thread: resolve placeholders, forward, sample, fill the future map,
        start the copy of the samples to the host. No host sync on CUDA."""
        stream = self._stream
        t0 = time.perf_counter()
        timing = None
        with torch.inference_mode(), (torch.cuda.stream(stream) if stream is not None
                                      else contextlib.nullcontext()):
            if stream is not None:
                assert ready is not None
                stream.wait_event(ready)
                timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                timing[0].record()
            sample_index, sample_seqs, logits, prompt_lps = self._forward(batch)
            host = None
            if logits is not None:
                # on the device; with a grammar it waits for the mask the scheduler thread fills
                drawn = self.sampler.sample_tensor(logits, sample_seqs, mask=batch.grammar_mask)
                base = batch.future_base
                self._future[base : base + drawn.tokens.shape[0]] = drawn.tokens
                host = drawn.to_host(non_blocking=True) if stream is not None else drawn
            done = None
            if stream is not None:
                assert timing is not None
                timing[1].record()
                done = torch.cuda.Event()
                done.record()
        if stream is None:
            self.busy_seconds += time.perf_counter() - t0
        return sample_index, sample_seqs, host, done, timing, prompt_lps

    def logits_for(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run the step like ``execute`` (KV is written) but return the logits (N, V) of
        the sampling sequences, in batch order, as float32 on the CPU."""
        with torch.inference_mode():
            logits = self._forward(batch).logits
        if logits is None:
            return torch.empty(0, self.vocab_size)
        return logits.float().cpu().clone()  # a normal (not inference-mode) tensor

    def _forward(self, batch: ScheduledBatch) -> StepForward:
        """The step's forward (see ``StepForward``)."""
        validate_batch(batch, self.block_size, self.kv_spec.num_blocks, self.max_model_len)
        # NOTE: a graph returns the sampled rows' logits only: a step with prompt logprobs to
        # compute runs eagerly.
        if self.graphs is not None and not any(s.prompt_targets for s in batch.seqs):
            key = self.graphs.bucket(batch)
            if key is not None:
                return self._graph_forward(batch, key)
        step = build_step_inputs(batch, self.block_size, self.device, self.dtype, per_token=self._one_call_rows(batch))
        ids = step.input_ids
        if step.has_futures:  # tokens the previous batch sampled: read on the device
            ids = torch.where(ids < 0, self._future[(-1 - ids).clamp_(min=0)], ids)
        with (sdpa_kernel(self.prefill_attention) if self.prefill_attention and step.meta.num_prefill_tokens
              else contextlib.nullcontext()):
            hidden = self.model(ids, step.positions, step.meta, self._kv_layers,
                                step.mm_rows, step.mm_embeds)  # (T, H)
        prompt_lps = (self._prompt_logprobs(hidden, batch, step.prompt_rows) if step.prompt_rows
                      else None)
        if not step.sample_index:
            return StepForward(step.sample_index, step.sample_seqs, None, prompt_lps)
        return StepForward(step.sample_index, step.sample_seqs,
                           self.model.compute_logits(hidden[step.sample_rows]), prompt_lps)

    @property
    def row_step_tokens(self) -> int:  # type: ignore[override]
        # NOTE: in deterministic mode every step is rows: one speed fits them all
        return ONE_CALL_PREFILL_TOKENS if self.model.cpu_decode is not None and not self.deterministic else 0

    def runs_as_rows(self, batch: ScheduledBatch) -> bool:
        # NOTE: the row regime is the small steps' (a larger one that also runs as rows,
        # engine.cpu_prefill, is timed against the prefill fit: regimes by size, not path)
        return (self.row_step_tokens > 0 and self._one_call_rows(batch)
                and _prefill_tokens(batch) <= self.row_step_tokens)

    def _one_call_rows(self, batch: ScheduledBatch) -> bool:
        """Whether the step runs on the one-call kernel with a row per token: every step in
        deterministic mode; otherwise one with a few prefill tokens and no image (a
        decode-only step takes the kernel's decode rows without asking)."""
        if self.deterministic:
            # NOTE: a CPU step with image rows takes the eager forward, which reads chunk masks
            return self.device.type == "cuda" or not any(s.images for s in batch.seqs)
        if self.model.cpu_decode is None or any(s.images for s in batch.seqs):
            return False
        n = _prefill_tokens(batch)
        return 0 < n and (n <= ONE_CALL_PREFILL_TOKENS or self.prefill_rows)

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: ScheduledBatch,
                         rows: list[tuple[int, int]]) -> PromptLogprobs:
        """The logprobs of each ``rows`` sequence's prompt_targets, from the logits of its
        first positions (one sequence at a time: a (n, V) float32 block per chunk)."""
        out: list[list[TokenLogprob] | None] = [None] * len(batch.seqs)
        for i, first in rows:
            s = batch.seqs[i]
            n = len(s.prompt_targets)
            k = s.sampling.prompt_logprobs or 0
            logits = self.model.compute_logits(hidden[first : first + n])  # (n, V)
            out[i] = prompt_token_logprobs(logits, s.prompt_targets, k)
        return out

    def _graph_forward(self, batch: ScheduledBatch, key: tuple[int, int]) -> StepForward:
        assert self.graphs is not None
        logits = self.graphs.run(batch, key, self._future)  # (n, V), batch order
        index = [i for i, s in enumerate(batch.seqs) if s.sample]
        seqs = [batch.seqs[i] for i in index]
        if not index:
            return StepForward(index, seqs, None)
        if len(index) < len(batch.seqs):
            logits = logits[torch.tensor(index, device=self.device)]
        return StepForward(index, seqs, logits)

    # -- KV transfer -----------------------------------------------------------------------

    def _block_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = list(block_ids)
        if ids and (min(ids) < 0 or max(ids) >= self.kv_spec.num_blocks):
            raise ValueError(f"block id out of range [0, {self.kv_spec.num_blocks}): {ids}")
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def export_kv(self, block_ids: Sequence[int]) -> torch.Tensor:
        idx = self._block_index(block_ids)
        # NOTE: outside inference_mode on purpose: the copy is a normal tensor the caller may
        # modify or serialise.
        with torch.no_grad():
            return self.kv_cache.index_select(2, idx)  # (layers, 2, n, block_size, kv_heads, hd)

    def import_kv(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        if not isinstance(data, torch.Tensor):
            raise ValueError(f"import_kv: data must be a torch.Tensor, got {type(data).__name__}")
        expected = self.local_kv_spec.block_range_shape(len(block_ids))
        if tuple(data.shape) != expected:
            raise ValueError(f"import_kv: KV shape {tuple(data.shape)} does not match expected {expected}")
        if data.dtype != self.kv_spec.dtype:
            raise ValueError(f"import_kv: KV dtype {data.dtype} does not match cache dtype {self.kv_spec.dtype}")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"import_kv: duplicate block ids {list(block_ids)}")
        idx = self._block_index(block_ids)
        with torch.inference_mode():
            self.kv_cache.index_copy_(2, idx, data.to(self.device))
