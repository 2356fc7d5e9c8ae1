"""The entry rank's runner: a TorchRunner on rank 0's slice that drives N-1 rank processes.

Rank 0 owns the scheduler, the sampler and everything outside the engine; the other ranks
run only the forward. Per request, ``request_added`` hands the prompt to the payload
broadcaster (broadcast.py); per step, ``_forward`` sends the step message (step_plan.py)
and then runs its own slice, meeting the other ranks in the all-reduces. Only rank 0
applies the (replicated) LM head. KV transfer gathers/scatters KV heads over the ranks, so
the KV a TP worker exports or imports has the whole model's layout (``kv_spec``).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import pickle
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from services.common.config import EngineConfig
from services.engine.batch import PendingOutput, ScheduledBatch
from services.engine.parallel import comm
from services.engine.parallel.shard import TpShard, check_tp_layout
from services.engine.quant.groups import QuantSource
from services.engine.request import GenerateRequest
from services.engine.runner.torch_runner import StepForward, TorchRunner
from services.engine.tp.broadcast import PayloadBroadcaster
from services.engine.tp.messages import (
    ExportKv,
    FutureSlots,
    ImportKv,
    RankFailed,
    RankReady,
    Shutdown,
)
from services.engine.tp.rank_main import (
    NUM_STATS,
    STAT_ALL_REDUCE_S,
    STAT_STEPS,
    STAT_WAIT_S,
    rank_main,
)
from services.engine.tp.step_plan import StepEncoder
from services.model.arch import ModelArchConfig

log = logging.getLogger(__name__)


class TpRankError(RuntimeError):
    """A tensor-parallel rank failed to start, died, or timed out."""


@dataclass(frozen=True, slots=True)
class RankStats:
    """Cumulative, per rank (rank 0 first); per-step values are these over ``steps``."""

    rank: int
    steps: int
    broadcast_wait_seconds: float  # rank 0: blocked in submitting payloads; others: waiting on them
    all_reduce_seconds: float


@dataclass(slots=True)
class _Rank:
    rank: int
    proc: mp.process.BaseProcess
    steps: Connection
    payloads: Connection
    stats: ctypes.Array[ctypes.c_double]  # shared with the rank (rank_main's STAT_* slots)


class TpRunner(TorchRunner):
    """Overlap: ``launch`` sends a batch's step message on the scheduler thread (in order with
    the request handles and the KV transfer commands; the forward thread only computes), its
    placeholders unresolved. Each message names the previous launched batch's future slots;
    before the forward, rank 0 broadcasts what its sampler wrote there and every rank copies
    it into its own future map, so the placeholders resolve on every rank as on rank 0."""

    def __init__(
        self,
        arch: ModelArchConfig,
        tensors: dict[str, torch.Tensor],
        cfg: EngineConfig,
        model_path: Path,
        max_model_len: int | None = None,
        quant_source: QuantSource | None = None,
    ) -> None:
        size = cfg.tensor_parallel_size
        check_tp_layout(arch, size)
        if torch.distributed.is_initialized():
            raise TpRankError("one tensor-parallel engine per process: this process already "
                              "has a torch.distributed group")
        self.tp_cfg = cfg
        self.num_failures = 0
        self.failure = ""  # what went wrong first, for the worker's exit
        self._rank0_steps = 0
        self.on_rank_death: Callable[[str], None] | None = None
        # Raw bytes sent with each request's payload besides its prompt and images (`tandem
        # bench tp` fills it to stand for large inputs).
        self.extra_payload: Callable[[GenerateRequest], bytes] = _no_extras
        self._closing = False
        self._ranks: list[_Rank] = []
        port = _free_port()
        ctx = mp.get_context("spawn")
        try:
            for r in range(1, size):
                step_here, step_there = ctx.Pipe()
                pay_here, pay_there = ctx.Pipe()
                stats = ctx.Array("d", NUM_STATS, lock=False)
                proc = ctx.Process(
                    target=rank_main, name=f"tandem-tp-rank{r}", daemon=True,
                    args=(r, size, port, str(model_path), cfg, max_model_len, step_there, pay_there, stats))
                proc.start()
                step_there.close()
                pay_there.close()
                self._ranks.append(_Rank(r, proc, step_here, pay_here, stats))
            super().__init__(arch, tensors, cfg, max_model_len, quant_source, tp=TpShard(0, size))
            self._await_ready()
            comm.init_group(0, size, port, self.device, cfg.tp_timeout_s)
        except BaseException:
            self._stop_ranks()
            comm.destroy_group()
            raise
        self._broadcaster = PayloadBroadcaster([r.payloads for r in self._ranks], cfg.tp_broadcast,
                                               cfg.tp_timeout_s)
        # NOTE: the overlapped loop under TP is tested on CPU (gloo) only: with NCCL it has
        # never run, so `overlap: auto` leaves it off there (`overlap: true` turns it on)
        self.overlap_pays = self.overlap_pays and self.device.type != "cuda"
        self._encoder = StepEncoder(cfg.block_size)
        self._handles: dict[str, int] = {}
        self._next_handle = 0
        self._dropped: list[int] = []
        # Overlap: the previous launched batch's (future_base, sampled rows), and the future
        # slots each launched batch's forward broadcasts first, by id(batch).
        self._last_sampled = (0, 0)
        self._ahead: dict[int, tuple[int, int]] = {}
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    # -- requests --------------------------------------------------------------------------

    def request_added(self, request: GenerateRequest) -> None:
        h = self._next_handle
        self._next_handle += 1
        self._handles[request.request_id] = h
        self._broadcaster.submit(h, request.prompt_token_ids, request.images, self.extra_payload(request))

    def request_gone(self, request_id: str) -> None:
        h = self._handles.pop(request_id, None)
        if h is None:
            return
        self._broadcaster.cancel(h)
        self._encoder.forget(h)
        self._dropped.append(h)

    # -- forward ---------------------------------------------------------------------------

    def reserve_future_slots(self, n: int) -> None:
        super().reserve_future_slots(n)
        self._last_sampled = (0, 0)  # a new map: nothing sampled into it yet
        for r in self._ranks:
            _send(r.steps, FutureSlots(n))

    def launch(self, batch: ScheduledBatch) -> PendingOutput:
        futures = self._last_sampled
        self._send_step(batch, futures)
        self._last_sampled = (batch.future_base, sum(1 for s in batch.seqs if s.sample))
        self._ahead[id(batch)] = futures
        return super().launch(batch)

    def _send_step(self, batch: ScheduledBatch, futures: tuple[int, int]) -> None:
        msg = self._encoder.encode(batch, self._handles, self._dropped, *futures)
        self._dropped = []
        self._rank0_steps += 1
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for r in self._ranks:
                r.steps.send_bytes(data)
        except OSError as e:
            raise self._forward_failed(e) from e

    def _forward(self, batch: ScheduledBatch) -> StepForward:
        futures = self._ahead.pop(id(batch), None)
        if futures is None:  # execute / logits_for: no placeholders, sent from here
            self._send_step(batch, (0, 0))
        try:
            if futures is not None and futures[1]:
                comm.broadcast_from_entry(self.future_slots(*futures))
            return super()._forward(batch)
        except (RuntimeError, OSError) as e:  # gloo/NCCL: a peer closed, or the timeout hit
            raise self._forward_failed(e) from e

    def _forward_failed(self, e: BaseException) -> TpRankError:
        self._fail(f"tensor-parallel forward failed (a rank died or a collective exceeded "
                   f"engine.tp_timeout_s={self.tp_cfg.tp_timeout_s}s): {e}")
        return TpRankError(self.failure)

    # -- KV transfer: the whole model's layout, gathered from / scattered to the ranks -----

    def export_kv(self, block_ids: Sequence[int]) -> torch.Tensor:
        kv_heads = self.kv_spec.num_kv_heads
        primaries = [r for r in self._ranks if TpShard(r.rank, len(self._ranks) + 1).holds_kv_primary(kv_heads)]
        for r in primaries:
            _send(r.steps, ExportKv(list(block_ids)))
        parts = [super().export_kv(block_ids)]  # rank 0 holds the first heads
        for r in primaries:
            if not r.steps.poll(self.tp_cfg.tp_timeout_s):
                raise TpRankError(f"rank {r.rank} did not export its KV within {self.tp_cfg.tp_timeout_s}s")
            parts.append(pickle.loads(r.steps.recv_bytes()))
        # (layers, 2, n, block_size, kv_heads, hd), on rank 0's device
        return torch.cat([p.to(parts[0].device) for p in parts], dim=4)

    def import_kv(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        if not isinstance(data, torch.Tensor):
            raise ValueError(f"import_kv: data must be a torch.Tensor, got {type(data).__name__}")
        expected = self.kv_spec.block_range_shape(len(block_ids))
        if tuple(data.shape) != expected:
            raise ValueError(f"import_kv: KV shape {tuple(data.shape)} does not match expected {expected}")
        kv_heads, size = self.kv_spec.num_kv_heads, len(self._ranks) + 1
        local = self.local_kv_spec.num_kv_heads
        for r in self._ranks:
            start = TpShard(r.rank, size).kv_head_start(kv_heads)
            _send(r.steps, ImportKv(list(block_ids), data[:, :, :, :, start : start + local].contiguous()))
        super().import_kv(block_ids, data[:, :, :, :, :local])

    # -- health and metrics ----------------------------------------------------------------

    @property
    def broadcaster(self) -> PayloadBroadcaster:
        return self._broadcaster

    def rank_stats(self) -> list[RankStats]:
        out = [RankStats(0, self._rank0_steps, self._broadcaster.blocked_seconds, comm.ALL_REDUCE.seconds)]
        for r in self._ranks:
            s = r.stats
            out.append(RankStats(r.rank, int(s[STAT_STEPS]), s[STAT_WAIT_S], s[STAT_ALL_REDUCE_S]))
        return out


    def close(self) -> None:
        """Stop the ranks and leave the group (idempotent)."""
        if self._closing:
            return
        self._closing = True
        self._broadcaster.close()
        self._stop_ranks()
        comm.destroy_group()

    def _stop_ranks(self) -> None:
        self._closing = True
        for r in self._ranks:
            try:
                _send(r.steps, Shutdown())
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for r in self._ranks:
            r.proc.join(max(0.1, deadline - time.monotonic()))
            if r.proc.is_alive():
                r.proc.kill()
                r.proc.join(5)

    def _await_ready(self) -> None:
        limit = self.tp_cfg.tp_startup_timeout_s
        deadline = time.monotonic() + limit
        for r in self._ranks:
            if not r.steps.poll(max(0.0, deadline - time.monotonic())):
                raise TpRankError(f"rank {r.rank} did not load the model within "
                                  f"engine.tp_startup_timeout_s={limit}s")
            try:
                msg = pickle.loads(r.steps.recv_bytes())
            except EOFError:
                r.proc.join(5)
                raise TpRankError(f"rank {r.rank} exited during startup (code {r.proc.exitcode})") from None
            if isinstance(msg, RankFailed):
                raise TpRankError(f"rank {msg.rank} failed to start: {msg.error}")
            assert isinstance(msg, RankReady)

    def _watch(self) -> None:
        by_sentinel = {r.proc.sentinel: r for r in self._ranks}
        ready = wait(list(by_sentinel))
        if self._closing:
            return
        r = by_sentinel[ready[0]]
        r.proc.join(5)  # reap it: its exit code is what the log names
        self._fail(f"tensor-parallel rank {r.rank} (pid {r.proc.pid}) exited with code "
                   f"{r.proc.exitcode}; this worker can no longer run its forward")

    def _fail(self, why: str) -> None:
        self.num_failures += 1
        if not self.failure:
            self.failure = why
        log.error(why)
        if self.on_rank_death is not None:
            self.on_rank_death(why)


def _no_extras(_request: GenerateRequest) -> bytes:
    return b""


def _send(conn: Connection, obj: object) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
