"""An extra tensor-parallel rank: a process that holds one slice of the model and of the
KV cache and runs only the forward, step by step as the entry rank tells it.

It exits when the entry says so, when the entry's pipe closes (the entry died), or when a
collective fails (a peer died or timed out): a rank never outlives its worker.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from services.common.config import EngineConfig
from services.common.malloc_tuning import tune_malloc
from services.engine.parallel import comm
from services.engine.parallel.shard import TpShard
from services.engine.tp.broadcast import PayloadReceiver
from services.engine.tp.messages import (
    ExportKv,
    FutureSlots,
    ImportKv,
    RankFailed,
    RankReady,
    Shutdown,
    StepMessage,
)
from services.engine.tp.step_plan import StepDecoder

log = logging.getLogger("tandem.tp.rank")

# Slots of the shared per-rank stats array (read by the entry for metrics).
STAT_STEPS, STAT_WAIT_S, STAT_ALL_REDUCE_S = 0, 1, 2
NUM_STATS = 3


def rank_main(
    rank: int,
    size: int,
    port: int,
    model_path: str,
    cfg: EngineConfig,
    max_model_len: int | None,
    step_conn: Connection,
    payload_conn: Connection,
    stats: ctypes.Array[ctypes.c_double],
) -> None:
    # NOTE: Ctrl-C reaches the whole foreground process group: the worker drains and then
    # stops its ranks; a rank that died of the SIGINT first would look like a failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tune_malloc()  # spawned, not started by the CLI: allocate as the worker does
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    try:
        runner = _start(rank, size, port, Path(model_path), cfg, max_model_len)
    except Exception as e:
        log.exception("rank %d failed to start", rank)
        _send(step_conn, RankFailed(rank, f"{type(e).__name__}: {e}"))
        os._exit(1)
    _send(step_conn, RankReady(rank))
    try:
        # NOTE: joined only once loaded: the entry joins once every rank is ready, so
        # loading (slow on a busy host) never eats into the collectives' timeout.
        comm.init_group(rank, size, port, runner.device, cfg.tp_timeout_s)
    except Exception:
        log.exception("rank %d failed to join the tensor-parallel group", rank)
        os._exit(1)
    receiver = PayloadReceiver(payload_conn, cfg.tp_broadcast == "sync", cfg.tp_timeout_s)
    decoder = StepDecoder(receiver.request, receiver.forget)
    try:
        while True:
            try:
                msg = pickle.loads(step_conn.recv_bytes())
            except (EOFError, OSError):
                log.error("rank %d: the entry rank's pipe closed; exiting", rank)
                os._exit(1)
            if isinstance(msg, StepMessage):
                batch = decoder.decode(msg)
                if msg.futures_count:  # rank 0's samples of the batch before (overlap)
                    comm.broadcast_from_entry(runner.future_slots(msg.futures_base, msg.futures_count))
                runner.execute(batch)
                stats[STAT_STEPS] += 1
                stats[STAT_WAIT_S] = decoder.wait_seconds
                stats[STAT_ALL_REDUCE_S] = comm.ALL_REDUCE.seconds
            elif isinstance(msg, FutureSlots):
                runner.reserve_future_slots(msg.n)
            elif isinstance(msg, ExportKv):
                _send(step_conn, runner.export_kv(msg.block_ids).cpu())
            elif isinstance(msg, ImportKv):
                runner.import_kv(msg.block_ids, msg.data)
            elif isinstance(msg, Shutdown):
                break
    except Exception as e:
        # NOTE: the entry's collective fails or times out on this rank's absence, and its
        # watchdog names the exit; this line says why. Most often a peer died and the
        # collective's message says so: the stack (DEBUG) adds nothing to it.
        log.error("rank %d: forward failed (%s: %s); exiting", rank, type(e).__name__, e)
        log.debug("rank %d: forward failure", rank, exc_info=True)
        os._exit(1)
    comm.destroy_group()


def _start(rank: int, size: int, port: int, model_path: Path, cfg: EngineConfig,
           max_model_len: int | None):
    from services.engine.factory import is_llava_dir
    from services.engine.runner.torch_runner import TorchRunner, resolve_device
    from services.engine.weights import load_weights

    device = resolve_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        cfg = cfg.model_copy(update={"device": str(device)})
    if is_llava_dir(model_path):  # the vision half runs on rank 0 (or an encode worker)
        from services.engine.multimodal.weights import load_llava_dir

        loaded = load_llava_dir(model_path).text
    else:
        loaded = load_weights(model_path)
    runner = TorchRunner(loaded.arch, loaded.tensors, cfg, max_model_len, loaded.quant, tp=TpShard(rank, size))
    if device.type == "cpu":
        torch.set_num_threads(cfg.tp_rank_threads)
    return runner


def _send(conn: Connection, obj: object) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
