"""The cluster config: one YAML file validated by pydantic.

Every model forbids unknown keys so a typo is an error that names the key, e.g.
``router.mode: Input should be 'kv', 'round_robin' or 'random'``.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.common import env


class ConfigError(ValueError):
    """A config file or override that does not validate; the message names the bad key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NatsConfig(_Strict):
    url: str = "nats://127.0.0.1:4222"
    embedded: bool = True
    user: str | None = None
    # Secrets stay out of reprs (a logged config must not leak them). Unset here, they are
    # read from TANDEM_NATS_USER / TANDEM_NATS_PASSWORD / TANDEM_NATS_TOKEN or their _FILE
    # twins (common/env.py).
    password: str | None = Field(None, repr=False)
    token: str | None = Field(None, repr=False)
    # TLS to the server (docs/operations.md): a CA file to trust instead of the system's,
    # and a client certificate and key when the server verifies clients. A tls:// url
    # alone uses TLS with the system's CAs.
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    # How long a part starting up waits for nats-server to accept it (retrying) before it
    # exits naming the server: a supervisor or Kubernetes then restarts it, where a part
    # that waited forever would sit unready without a word. Later losses of the server are
    # waited out for as long as they last.
    startup_wait_s: float = Field(60.0, gt=0)


class ModelConfig(_Strict):
    path: str = "auto"  # auto = the default SmolLM2 GGUF; or a .gguf file / HF directory
    name: str | None = None  # the served model name; default: derived from the path


class MockRunnerConfig(_Strict):
    """Cost model of the mock runner: a step sleeps a + b*prefill_tokens + c*decode_seqs."""

    step_base_s: float = Field(0.004, ge=0)
    per_prefill_token_s: float = Field(0.0015, ge=0)
    per_decode_seq_s: float = Field(0.0008, ge=0)
    vocab_size: int = Field(49152, gt=0)
    eos_token_id: int = Field(2, ge=0)
    # The mock model's own context, as a real model's files state theirs; a set
    # engine.max_model_len replaces it (the mock has no positions to run out of).
    context_length: int = Field(8192, gt=0)
    # Chance that a sampled token is eos (a deterministic function of the context);
    # 0 (the default) never produces eos, so output lengths are exactly max_tokens.
    eos_probability: float = Field(0.0, ge=0, le=1)


# NOTE: engine.itl_target_ms's default: the lowest ITL p99 of `tandem bench budget` at the
# default token budget on the shipped CPU profile's machine; below ~60 ms every chunk beside 8
# streams is held to one block, which slows prefill ~3x without lowering the tail there
# (docs/benchmarks.md "The prefill budget under an ITL target").
ITL_TARGET_MS = 100.0
# NOTE: engine.lone_step_target_ms's default: ~256 tokens a step alone on the shipped CPU
# profile's machine, where a 768-token prompt prefills within 1% of one whole step (128
# tokens: -9%, 64: -22%; docs/benchmarks.md "What waits for a step").
LONE_STEP_TARGET_MS = 450.0


class EngineConfig(_Strict):
    runner: Literal["torch", "mock"] = "torch"
    # This engine's step-time model (docs/simulator.md "Step-time models"): "mock", the mock
    # runner's costs (engine.mock); a path, a profile YAML from `tandem sim profile`; "auto",
    # mock for the mock runner, else the CPU profile shipped for the default model. The
    # router's ttft policy and the remote-prefill decision predict time with it; the
    # simulator runs it as its device.
    step_model: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    threads: int = Field(1, ge=1)
    # Weight-only quantized linears (docs/engine.md "Dtype and quantized weights"): int4 / int8 weights,
    # activations in `dtype`. auto: int4 for a 4-bit GGUF (dtype auto is then bfloat16), else none.
    quantization: Literal["auto", "none", "int8", "int4"] = "auto"
    # With quantization on, a forward over more rows than this (prefill chunks) uses a
    # dense copy of the weights, which a GEMM beats the int4/int8 kernels with; null keeps
    # no dense copy (least memory; every batch on the quantized kernels). auto: 16, except
    # bfloat16 on a CPU without native bfloat16, where the int8 kernels beat the emulated
    # dense GEMM at every size: null there.
    quantized_max_rows: Annotated[int, Field(ge=0)] | None | Literal["auto"] = "auto"
    block_size: int = Field(16, ge=1)
    num_kv_blocks: int = Field(2048, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(1024, ge=1)
    # While other requests wait, one prompt's prefill takes at most this many tokens of a
    # step's budget, so a short request behind a long one starts within a step (its TTFT is
    # bounded by a chunk, not by the long prompt). Clamped to max_num_batched_tokens.
    long_prefill_token_threshold: int = Field(512, ge=1)
    # The order waiting prompts prefill in (docs/engine.md "Prefill order"). "share": the
    # threshold above, so prompts that wait together progress together. "fifo": they finish
    # in arrival order: a step takes a prompt beside one still prefilling only when all of
    # it fits, and one prompt may take the whole budget. "auto": fifo on a prefill worker
    # (its prompts are all long and no stream waits on it: sharing only delays every
    # first token to the last one's), share elsewhere.
    prefill_order: Literal["auto", "share", "fifo"] = "auto"
    # The ITL the running streams keep while prompts prefill beside them (docs/engine.md
    # "The ITL target"): each step's prefill is cut to what the step-time model
    # (step_model) says fits in this many ms beside the step's decodes, at least one block
    # a step. 0 or null: the token budgets alone. Off on a CUDA device under step_model
    # auto, whose shipped profile models a CPU (profile the device to set one there).
    itl_target_ms: Annotated[float, Field(ge=0)] | None = ITL_TARGET_MS
    # With no stream running beside it (nothing for itl_target_ms to protect), a step's
    # prefill is cut to what the same step-time model says fits in this many ms, at least one
    # block: whatever arrives mid-step -- a short prompt, a remote prefill's KV, the lookup
    # of a decision -- waits at most about this long for the step thread, where it waited
    # for a whole long prompt's step (docs/engine.md "The ITL target"). Applies where the ITL
    # target does, only while requests overlap (Scheduler.solo_arrivals), and not to a fifo
    # prefill worker. 0 or null: the token budget alone.
    lone_step_target_ms: Annotated[float, Field(ge=0)] | None = LONE_STEP_TARGET_MS
    max_model_len: int | None = Field(None, ge=1)  # default: the model's context length
    # After a choice's first token, its tokens go out to the client together once this many
    # are made (or it ended), as vLLM's and SGLang's --stream-interval; 1: every token as it
    # is made. Each output is one message through every hop (worker, processor, frontend,
    # SSE), whose CPU a loaded CPU machine takes from the engine. "auto": 2 in steps of 16
    # sequences or more, else 1; 1 on the mock runner, whose per-token timing the simulator
    # is calibrated against (docs/benchmarks.md "Tokens per message").
    stream_interval: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    seed: int = 0
    # Schedule step N+1 while step N computes (docs/engine.md "The overlapped loop");
    # false runs the strictly serial loop, for debugging and for the comparison. "auto": on
    # where it pays -- a CUDA device, the mock runner's simulated one, the CPU decode
    # kernels' one-call step -- and off for the eager torch forward on CPU, where the
    # forward already takes every core and a second thread only competes with it
    # (docs/benchmarks.md "Overlap scheduler": 0.78-0.97x there).
    overlap: bool | Literal["auto"] = "auto"
    # Threads that fill structured output's token masks (docs/engine.md "Constrained
    # decoding"); 0: half the CPUs, 1 to 8. Each is a lane: a schema is compiled once per
    # lane, since copies of one compiled grammar fill one at a time.
    grammar_threads: int = Field(0, ge=0)
    # Tensor parallelism (docs/engine.md, "Tensor parallelism"): N > 1 starts N-1 extra rank
    # processes that each hold a 1/N slice of the model and of the KV cache. Request payloads
    # reach them on a background thread ("async") or inline on the step thread ("sync", for
    # the comparison); every collective and control message waits at most tp_timeout_s.
    tensor_parallel_size: int = Field(1, ge=1)
    tp_broadcast: Literal["async", "sync"] = "async"
    tp_timeout_s: float = Field(60.0, gt=0)
    tp_startup_timeout_s: float = Field(300.0, gt=0)  # for every rank to load its slice
    tp_rank_threads: int = Field(1, ge=1)  # torch threads of each extra rank on CPU
    # Decode-only steps replay CUDA graphs captured at start-up, one per (batch size,
    # context) bucket up to max_num_seqs x cuda_graph_max_context tokens (docs/engine.md
    # "CUDA graphs"). "auto": on with a CUDA device; CPU has none (true there is an error).
    cuda_graphs: bool | Literal["auto"] = "auto"
    cuda_graph_max_context: int = Field(2048, ge=1)
    # Our own kernels for int4 matmuls and decode-only steps on CPU (docs/engine.md "CPU
    # decode kernels"), built with g++ at first use. "auto": on where the CPU has one of
    # cpu_isa's sets and the build works, else torch's kernels; true: an error where they cannot run.
    cpu_kernels: bool | Literal["auto"] = "auto"
    # Which instruction set's build of those kernels runs: auto = the best the CPU's flags
    # allow; a named set the CPU lacks is a start-up error; none = torch's kernels only
    # (cpu_kernels/isa.py; neon on aarch64). A named set without bfloat16 stands in for a CPU
    # that has only it: dtype and quantized_max_rows auto then choose as they would there.
    cpu_isa: Literal["auto", "avx512_bf16", "avx512_vnni", "avx512", "avx2", "neon", "none"] = "auto"
    # Batch-invariant forward: a token's logits are the same bits whatever shares its step,
    # however its prompt is chunked, cache hit or not (so a seeded request's text is too).
    # CPU with the int4 kernels only (every step through their one-call kernel); a model
    # or device where they cannot run is a start-up error. Costs prefill speed
    # (docs/engine.md, "Deterministic mode").
    deterministic: bool = False
    # Which path runs a CPU step's prefill of more than a few tokens (fewer always run as
    # rows): rows = the int4 kernels' one-call step, a row per token; eager = torch's
    # forward (its attention, and above quantized_max_rows the dense copy); auto = rows on
    # the avx2 kernels, where that measured faster at every size (docs/engine.md "CPU
    # decode kernels"), eager on the others. rows without the one-call step (no int4
    # kernels, TP > 1) is a start-up error. Steps with images always take the eager forward.
    cpu_prefill: Literal["auto", "rows", "eager"] = "auto"
    # The CPU kernels' packed weights copied onto transparent huge pages where the OS gives
    # them on request (Linux, THP always or madvise): a decode step streams every weight
    # byte, and on 4 KiB pages each page costs a TLB miss (docs/engine.md "Decode fast path").
    cpu_huge_pages: bool = True
    mock: MockRunnerConfig = MockRunnerConfig()


class FrontendConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # Empty: no auth; else `Authorization: Bearer <key>` required. Kept out of reprs. Empty
    # in the file and overrides: read from TANDEM_API_KEYS / TANDEM_API_KEYS_FILE by
    # load_config (common/env.py), so the keys need not be in the file or on a command line.
    api_keys: list[str] = Field([], repr=False)
    max_body_bytes: int = Field(1_048_576, ge=1)  # larger request bodies get 413
    request_timeout_s: float = Field(600.0, gt=0)  # a request running longer is ended (504)
    retry_after_s: int = Field(1, ge=0)  # the Retry-After of a 503 (no workers) or 429 (full)
    # The largest max_tokens (max_completion_tokens) a request may ask for; more is a 400.
    # A request that gives none is still bounded by the context length.
    max_tokens_limit: int = Field(4096, ge=1)
    # The processor's gRPC host:port; None: found in discovery (role "processor").
    processor_address: str | None = None
    drain_timeout_s: float = Field(30.0, ge=0)  # on SIGTERM, in-flight requests get this long
    # POST /reset_prefix_cache waits this long for every decode and prefill worker that
    # discovery lists to confirm (a worker evicts between two engine steps), else 503.
    cache_reset_timeout_s: float = Field(10.0, gt=0)
    # HTTP read deadlines (docs/operations.md, "HTTP timeouts and limits"): a request's
    # headers must arrive within header_timeout_s of its first byte (or of the connection
    # opening), its body within body_timeout_s of the headers (else 408); an idle
    # keep-alive connection, or the unread rest of an answered request's body, is closed
    # after keep_alive_timeout_s.
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    keep_alive_timeout_s: float = Field(5.0, gt=0)


class ProcessorConfig(_Strict):
    port: int = Field(9100, ge=0, le=65535)
    metrics_port: int = Field(9101, ge=0, le=65535)
    # The router's gRPC host:port; None: found in discovery (role "router").
    router_address: str | None = None
    drain_timeout_s: float = Field(30.0, ge=0)  # on SIGTERM, in-flight streams get this long
    # A stream whose decode worker dies (or refuses it) moves to another worker at most this
    # many times, carrying the tokens produced so far; 0 turns migration off.
    migration_limit: int = Field(3, ge=0)


class RouterMode(enum.StrEnum):
    """How a router picks among the live decode workers (docs/router.md)."""

    KV = "kv"  # prefix overlap against load, a linear blend (router/selection.py)
    TTFT = "ttft"  # the lowest predicted time to first token (router/ttft.py)
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"


class RouterConfig(_Strict):
    mode: RouterMode = RouterMode.KV
    # Router processes `tandem up` starts; replica i serves on port + i and metrics_port + i
    # (the two ranges must not overlap: at 2 or more, move metrics_port off 9201). A Deployment
    # (k8s) or `--scale` (compose) sets its own count: each of those is replica 0 in its pod.
    replicas: int = Field(1, ge=1)
    port: int = Field(9200, ge=0, le=65535)
    metrics_port: int = Field(9201, ge=0, le=65535)
    # NOTE: 4, not 1: a block to prefill costs far more time than a block of decode memory
    # (docs/benchmarks.md "Routing at scale": 1, 2, 4, 8 measured; hit rate and mean TTFT
    # improved at every step). 8 was better still there, but then a burst on one prefix
    # piles onto the worker holding it (10 of 16 in test_burst_sharing_a_system_prompt_spreads).
    overlap_weight: float = Field(4.0, ge=0)
    temperature: float = Field(0.0, ge=0)
    # kv and ttft modes: a cached block the request's prefill would evict, priced as this fraction of
    # a block to prefill (services/router/selection.py). Not 0: new conversations would
    # crowd onto the workers already caching the system prompt while others' caches sit
    # empty (docs/benchmarks.md "The whole conversation trace": 0.1, 0.5 and 1 measured;
    # 0.5 the best at 64 workers, 1 a little better at 8).
    eviction_weight: float = Field(0.5, ge=0)
    # ttft mode: workers predicted within this fraction of the fastest count as tied, and
    # the tie goes to the most cached prefix (cache affinity keeps later turns' hits).
    affinity_band: float = Field(0.1, ge=0)
    # ttft mode: weight of the newest (actual - predicted) TTFT in a worker's bias. 0 (off)
    # by default: on a cluster of like workers the bias follows the TTFT's noise and costs
    # hit rate (docs/benchmarks.md "Choosing the decisions"); 0.05 for unlike workers or an
    # engine without its own profile.
    ttft_bias_alpha: float = Field(0.0, ge=0, le=1)
    # Routed-but-unfinished requests are forgotten after this long without a free
    # (a processor that died mid-request must not pin load on a worker forever).
    inflight_ttl_s: float = Field(600.0, gt=0)
    # Load metrics older than this are ignored (the worker stopped reporting).
    load_stale_s: float = Field(5.0, gt=0)
    dump_timeout_s: float = Field(5.0, gt=0)
    # Events buffered per worker while its dump is in flight; beyond it (or beyond
    # max_blocks_per_worker blocks in them) the dump is redone.
    max_buffered_batches: int = Field(10_000, ge=1)
    # A failed dump request is retried after 0.05 s, doubling per failure up to this.
    dump_retry_max_s: float = Field(30.0, gt=0)
    # Blocks the index keeps per worker; stored events past it are refused and counted
    # (tandem_router_events_ignored_total{reason="over_limit"}). Generous: a worker caches at
    # most its KV pool (engine.num_kv_blocks, 2048 by default). It bounds what a publisher
    # under a registered worker's id can make a router hold: ~400 bytes per indexed block
    # (measured), so ~0.4 GB per worker at the default.
    max_blocks_per_worker: int = Field(1 << 20, ge=1)


class DisaggConfig(_Strict):
    enabled: bool = True
    # How a prompt past the bounds below is placed (docs/architecture.md "Remote prefill
    # decision"): "predict", where its first token is predicted sooner (local queue and
    # chunks beside the running streams against queue wait, remote prefill and KV transfer,
    # from engine.step_model); "threshold", always remote.
    policy: Literal["predict", "threshold"] = "predict"
    # predict: a prefill chunk that would stretch the running streams' step past this goes
    # remote even when local is predicted sooner (0: no ITL target).
    itl_target_ms: float = Field(0.0, ge=0)
    # predict: the local side's cost counts the delay a local prefill adds to each running
    # stream, times the streams, times this (0: the request's own TTFT alone). 0.5: the
    # TTFT tail of a long-prompt mix ~10% lower than at 1, the streams' ITL within its
    # spread (docs/benchmarks.md "The ITL weight").
    itl_weight: float = Field(0.5, ge=0)
    # predict: the local side's cost also counts the wait a local prefill makes the
    # requests arriving meanwhile sit out (this worker's recent arrival rate x the prefill's
    # time, each half of it), times this (0: not counted). 0.25: chosen in the simulator
    # (docs/benchmarks.md "The arrivals' wait").
    arrival_weight: float = Field(0.25, ge=0)
    # predict: what the KV of a remote prefill is expected to move at (measured 1.1-1.4 GB/s
    # on loopback, docs/benchmarks.md), and the transfer's fixed cost.
    kv_transfer_gbps: float = Field(1.0, gt=0)
    kv_transfer_latency_s: float = Field(0.002, ge=0)
    # predict: each side's predictions are scaled by the measured / predicted time to the
    # first token this worker has seen there, a moving average that takes this weight of
    # each new request (0: no correction). Off: on a 2-vCPU machine 0.1 cut TTFT p99 by
    # ~0.9 s and SLO attainment by 5-8 points (docs/benchmarks.md).
    prediction_correction: float = Field(0.0, ge=0, le=1)
    max_local_prefill_length: int = Field(256, ge=0)
    max_prefill_queue_size: int = Field(8, ge=0)
    max_prefill_queue_tokens: int = Field(32768, ge=0)
    # A remote prefill is abandoned (and its job cancelled) when no prefill worker has
    # reported progress on it for this long: not taken from the queue by then, or its worker
    # gone silent. Not a bound on the whole prefill: a long prompt that keeps reporting is
    # waited for. Must exceed prefill.in_progress_interval_s.
    remote_prefill_timeout_s: float = Field(15.0, gt=0)
    # The prefill queue depth (a JetStream consumer info round trip) is reused this long.
    queue_depth_cache_s: float = Field(0.2, ge=0)


class DecodeConfig(_Strict):
    replicas: int = Field(1, ge=0)
    port: int = Field(9300, ge=0, le=65535)  # replica i uses port + i
    metrics_port: int = Field(9400, ge=0, le=65535)
    # The host other processes use to reach this worker's gRPC port, as published in
    # discovery: a container name in compose, the pod IP in Kubernetes.
    advertise_host: str = "127.0.0.1"
    disagg: DisaggConfig = DisaggConfig()
    # Generate calls in flight beyond this are refused with RESOURCE_EXHAUSTED.
    max_inflight_requests: int = Field(1024, ge=1)
    # Requests in flight but not running (waiting for a batch slot or KV blocks, or parked
    # for a remote prefill) beyond this are refused with RESOURCE_EXHAUSTED: the frontend
    # answers 429 + Retry-After instead of letting the queue (and every wait in it) grow.
    max_waiting_requests: int = Field(256, ge=0)
    # On SIGTERM: stop taking requests, let in-flight ones finish (or move) for this long,
    # then exit.
    grace_period_s: float = Field(10.0, ge=0)
    # What a drained (SIGTERM'd) worker does with its running requests: "move" them, KV and
    # all, to other decode workers (docs/reliability.md "Moving requests on scale-down"), or
    # "finish" them here within grace_period_s.
    drain: Literal["move", "finish"] = "move"
    # How long a moved request's KV waits on the draining worker for its target to pull it;
    # past that its blocks are freed and the target prefills it again (the replay).
    move_timeout_s: float = Field(5.0, gt=0)
    # Prefill workers' reusable KV segments this worker keeps mapped (by name, least recently
    # used dropped past it), so their next transfers reuse the mapping; in bytes.
    kv_shm_mapped_bytes: int = Field(2 << 30, ge=0)
    # Decode workers hosted by one process (`tandem decode --replicas-in-process K`): for
    # the mock runner at scale (configs/scale-mock.yaml); keep 1 for real models.
    replicas_per_process: int = Field(1, ge=1)


class PrefillConfig(_Strict):
    replicas: int = Field(1, ge=0)
    metrics_port: int = Field(9500, ge=0, le=65535)
    # Jobs one prefill worker pulls and runs at once (its engine batches them).
    max_concurrent_jobs: int = Field(4, ge=1)
    # JetStream redelivers a job not acked (nor marked in progress) within this long.
    ack_wait_s: float = Field(10.0, gt=0)
    # A running job sends an in-progress ack this often (must be well under ack_wait_s).
    in_progress_interval_s: float = Field(2.0, gt=0)
    # A failed job is nak'ed with this delay so another worker (or this one) retries it.
    nak_delay_s: float = Field(0.2, ge=0)
    max_deliver: int = Field(5, ge=1)  # deliveries of one job before JetStream drops it
    # KvTransfer payload bytes per gRPC message (the decode worker accepts messages up to
    # 16 MiB + 64 KiB: services/decode/grpc_server.py MAX_KV_MESSAGE_BYTES).
    kv_chunk_bytes: int = Field(1 << 20, ge=1024, le=16 << 20)
    # A KV transfer to a decode worker that takes longer than this is abandoned (the job is
    # retried); the decode worker keeps waiting meanwhile, as progress goes on.
    kv_send_timeout_s: float = Field(60.0, gt=0)
    # "auto": KV goes through /dev/shm when the job's decode worker is on this host (same
    # kv_shm.host_id), else gRPC bytes; "grpc": always gRPC bytes.
    kv_transport: Literal["auto", "grpc"] = "auto"
    # Reusable /dev/shm segments this worker keeps for the same-host KV path, in bytes
    # (services/disagg/shm_pool.py): a transfer writes into pages mapped already, at memory
    # speed. Past it (or 0) a transfer gets a one-shot segment (tmpfs page faults: ~3x slower).
    kv_shm_pool_bytes: int = Field(1 << 30, ge=0)
    grace_period_s: float = Field(10.0, ge=0)
    # A job's KV goes only to the address discovery lists for its decode worker; a job
    # naming one not (yet) listed waits this long for discovery before it is refused
    # (a decode worker's registration can reach this worker after its first job).
    discovery_wait_s: float = Field(2.0, ge=0)


class DiscoveryConfig(_Strict):
    """NATS KV discovery: a key per instance, refreshed every ``heartbeat_s``, gone after ``ttl_s``."""

    ttl_s: float = Field(10.0, gt=0)
    heartbeat_s: float = Field(3.0, gt=0)

    @model_validator(mode="after")
    def _check_heartbeat(self) -> DiscoveryConfig:
        if self.heartbeat_s >= self.ttl_s:
            raise ValueError("discovery.heartbeat_s must be shorter than discovery.ttl_s")
        return self


class LauncherConfig(_Strict):
    """`tandem up` itself: its /metrics endpoint and how it restarts a part that dies
    (docs/operations.md, "Supervision")."""

    # The launcher's own /metrics (tandem_launcher_*); null: no endpoint.
    metrics_port: int | None = Field(9000, ge=1, le=65535)
    # A part that dies waits this long before its first restart, twice as long before each
    # next one, up to restart_backoff_max_s.
    restart_backoff_s: float = Field(0.5, gt=0)
    restart_backoff_max_s: float = Field(30.0, gt=0)
    # A part ready and up this long is healthy again: its backoff and its count of quick
    # failures start over. A death before that is a quick failure.
    stable_after_s: float = Field(60.0, gt=0)
    # Quick failures in a row that are still restarted; the next one stops the cluster with
    # an error naming the part (a part that cannot start, e.g. a bad path in the config).
    max_quick_restarts: int = Field(5, ge=0)

    @model_validator(mode="after")
    def _check_backoff(self) -> LauncherConfig:
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError("launcher.restart_backoff_max_s must be at least launcher.restart_backoff_s")
        return self


class MultimodalConfig(_Strict):
    """Image inputs of a LLaVA model (docs/architecture.md, "Multimodal requests")."""

    # Remote http(s) image URLs are refused (400) unless this is set; then fetched with
    # remote_fetch_timeout_s and max_image_bytes.
    allow_remote_urls: bool = False
    remote_fetch_timeout_s: float = Field(10.0, gt=0)
    # Of the decoded file, per image. NOTE: the request body (base64, 4/3 larger) must also
    # fit frontend.max_body_bytes and the processor's 4 MiB gRPC message limit.
    max_image_bytes: int = Field(2 << 20, ge=1)
    max_images_per_request: int = Field(8, ge=0)
    max_image_pixels: int = Field(16_000_000, ge=1)  # width * height, checked before decoding
    # Embedding transfer (engine/multimodal/transfer.py): rows per block, the language side's first buffer, and
    # the buffer's size in blocks on each side.
    block_size: int = Field(128, ge=1)
    default_blocks: int = Field(8, ge=1)
    num_blocks: int = Field(256, ge=1)
    # A language side waits this long for one chunk before resuming on another encoder.
    encode_timeout_s: float = Field(30.0, gt=0)
    embedding_cache_entries: int = Field(256, ge=0)  # LRU of image embeddings by content hash
    # Reusable /dev/shm segments the worker that prefills offers an encode worker on its host
    # to write the rows into (services/disagg/shm_pool.py), in bytes; 0: always gRPC bytes.
    shm_pool_bytes: int = Field(256 << 20, ge=0)

    @model_validator(mode="after")
    def _check_blocks(self) -> MultimodalConfig:
        if self.default_blocks > self.num_blocks:
            raise ValueError("multimodal.default_blocks must be at most multimodal.num_blocks")
        return self


class EncodeConfig(_Strict):
    """Encode workers: the vision half of a LLaVA model, apart from the workers that prefill.
    0 replicas: the worker that prefills encodes its requests' images itself."""

    replicas: int = Field(0, ge=0)
    port: int = Field(9600, ge=0, le=65535)  # replica i uses port + i
    metrics_port: int = Field(9700, ge=0, le=65535)
    advertise_host: str = "127.0.0.1"  # what discovery publishes (a service name, a pod IP)
    # A transfer no resume touched this long is freed (its language side died).
    stale_transfer_s: float = Field(60.0, gt=0)
    grace_period_s: float = Field(5.0, ge=0)
    # Language sides' reusable embedding segments this worker keeps mapped (by name, least
    # recently used dropped past it), in bytes.
    shm_mapped_bytes: int = Field(512 << 20, ge=0)


class SimConfig(_Strict):
    """`tandem sim` only (docs/simulator.md); the cluster's parts ignore it."""

    # Frontend + processor + router time before a request reaches its decode worker.
    request_overhead_s: float = Field(0.0, ge=0)
    # KV moved per prompt token on a remote prefill (SmolLM2-135M in bf16: 30 layers x K,V
    # x 3 heads x 64 dims x 2 bytes), and the link it moves over.
    kv_bytes_per_token: int = Field(23040, ge=1)
    kv_transfer_gbps: float = Field(1.0, gt=0)
    kv_transfer_latency_s: float = Field(0.002, ge=0)
    # How often each decode worker's load sample reaches the router (LoadPublisher's).
    load_interval_s: float = Field(0.25, gt=0)
    # How long an in-flight update one router replica makes (a route's add, a report it
    # applies) takes to reach the other replicas (a NATS publish); router.replicas > 1 only.
    inflight_delay_s: float = Field(0.002, ge=0)
    # The CPUs of one host that every worker shares, and the runnable threads of other work
    # on it: the OS shares CPUs among runnable threads, so a step composed while k workers
    # step (itself among them) takes its model's time x max(1, (k x engine.threads +
    # host_background) / host_cpus). 0 CPUs: no sharing, each worker has cores of its own.
    host_cpus: float = Field(0.0, ge=0)
    host_background: float = Field(0.0, ge=0)
    # How far a step's time scatters around its model, drawn per step (seeded): the
    # relative standard deviation of a mean-1 lognormal factor. A real engine's steps of one
    # shape scatter 5-20% around its profile's fit, and an engine under an ITL target plans
    # on that scatter (DeviceSpeed's spread), which tips its remote-prefill decisions near a
    # tie. 0: every step takes its model's time exactly.
    step_noise: float = Field(0.0, ge=0, le=1)
    # Goodput targets, in milliseconds: keys ttft_ms, tpot_ms, itl_ms, e2e_ms.
    slo: dict[str, float] = {"ttft_ms": 2000.0}
    seed: int = 0

    @field_validator("slo")
    @classmethod
    def _slo_keys(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(set(v) - {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"})
        if bad:
            raise ValueError(f"unknown SLO keys {bad}: use ttft_ms, tpot_ms, itl_ms, e2e_ms")
        if any(x <= 0 for x in v.values()):
            raise ValueError("SLO targets must be > 0")
        return v


class PlannerConfig(_Strict):
    """`tandem planner`: moves the prefill/decode split with the load (docs/planner.md).

    The parts ignore it; the launcher, compose and k8s start the planner when ``enabled``."""

    enabled: bool = False
    # Targets: the planner sizes the split so that the next intervals' quantiles stay under
    # them.
    ttft_p90_s: float = Field(2.0, gt=0)
    itl_p90_s: float = Field(0.1, gt=0)
    min_prefill: int = Field(0, ge=0)
    max_prefill: int = Field(4, ge=0)
    min_decode: int = Field(1, ge=1)
    max_decode: int = Field(8, ge=1)
    max_total_workers: int = Field(8, ge=1)
    # One decision per interval; a change waits cooldown_s after the one before it.
    interval_s: float = Field(10.0, gt=0)
    cooldown_s: float = Field(30.0, ge=0)
    # How candidate splits are judged: "formula" (tokens to prefill per second against
    # measured prefill throughput, KV blocks and ITL for decode) or "simulate" (the formula's
    # neighbours run forward in the simulator from the cluster's state).
    policy: Literal["formula", "simulate"] = "simulate"
    lookahead_intervals: int = Field(3, ge=1)
    # Workers are released only as far as every decision of this long allowed (0: at once);
    # scale up and shifts between the roles at once (services/planner/stabilize.py).
    scale_down_window_s: float = Field(60.0, ge=0)
    # simulate: where candidate splits tie, the one that would serve best the load of this
    # long ago that differed most (the heaviest prompt load and the heaviest output load
    # seen) wins: a load that shifted and shifts back finds both roles staffed (0: off).
    hedge_window_s: float = Field(300.0, ge=0)
    # Seconds from a start to a worker ready (model load, registration): what the lookahead
    # charges a scale-up. Measured by the actuator where it can be; this is the prior.
    worker_ready_s: float = Field(10.0, ge=0)
    # local: `tandem up`'s supervisor; kubernetes: the Deployments' scale; observe: decide,
    # log and export only (the split discovery sees; a dry run of a policy on live traffic);
    # sim: `tandem sim`.
    actuator: Literal["local", "kubernetes", "observe", "sim"] = "local"
    metrics_port: int | None = Field(9650, ge=1, le=65535)
    # local: the `tandem up` launcher's control endpoint the planner calls (bound to
    # 127.0.0.1, the cluster token required; docs/planner.md, "The control endpoint").
    control_port: int = Field(9651, ge=1, le=65535)
    # kubernetes: the Deployments scaled, in k8s_namespace (None: the planner pod's own).
    k8s_namespace: str | None = None
    k8s_prefill_deployment: str = "prefill"
    k8s_decode_deployment: str = "decode"

    @model_validator(mode="after")
    def _check_bounds(self) -> PlannerConfig:
        if self.max_prefill < self.min_prefill:
            raise ValueError("planner.max_prefill must be at least planner.min_prefill")
        if self.max_decode < self.min_decode:
            raise ValueError("planner.max_decode must be at least planner.min_decode")
        if self.max_total_workers < self.min_prefill + self.min_decode:
            raise ValueError("planner.max_total_workers must be at least min_prefill + min_decode")
        return self


class ClusterConfig(_Strict):
    namespace: str = Field("tandem", pattern=r"^[A-Za-z0-9_-]+$")
    # The interface every part's gRPC and metrics ports listen on (the frontend's HTTP port
    # has frontend.host): loopback on one machine; 0.0.0.0 in containers and pods.
    bind_host: str = "127.0.0.1"
    nats: NatsConfig = NatsConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    frontend: FrontendConfig = FrontendConfig()
    processor: ProcessorConfig = ProcessorConfig()
    router: RouterConfig = RouterConfig()
    decode: DecodeConfig = DecodeConfig()
    prefill: PrefillConfig = PrefillConfig()
    launcher: LauncherConfig = LauncherConfig()
    multimodal: MultimodalConfig = MultimodalConfig()
    encode: EncodeConfig = EncodeConfig()
    sim: SimConfig = SimConfig()
    planner: PlannerConfig = PlannerConfig()

    @model_validator(mode="after")
    def _check_budget(self) -> ClusterConfig:
        if self.engine.max_num_batched_tokens < self.engine.block_size:
            raise ValueError(
                "engine.max_num_batched_tokens must be at least engine.block_size"
            )
        if self.decode.disagg.remote_prefill_timeout_s <= self.prefill.in_progress_interval_s:
            raise ValueError(
                "decode.disagg.remote_prefill_timeout_s must exceed prefill.in_progress_interval_s "
                "(the prefill worker reports progress that often)")
        return self


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {key}: {e['msg']}")
    return "\n".join(lines)


def _apply_override(data: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set has an empty key segment in {key!r}")
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {p} is not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def parse_config(data: dict[str, Any] | None, overrides: list[str] = (), source: str = "") -> ClusterConfig:
    data = dict(data or {})
    for o in overrides:
        _apply_override(data, o)
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err, source or "(inline)")) from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> ClusterConfig:
    """Read a cluster YAML (None: all defaults) and apply ``key.sub=value`` overrides;
    ``frontend.api_keys`` left empty by both come from the environment (common/env.py)."""
    data: Any = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config {p} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config {p} must be a mapping at the top level")
    cfg = parse_config(data, list(overrides), str(path or "defaults"))
    if not cfg.frontend.api_keys:
        try:
            keys = env.api_keys()
        except ValueError as e:
            raise ConfigError(f"frontend.api_keys: {e}") from None
        if keys:
            cfg = cfg.model_copy(update={"frontend": cfg.frontend.model_copy(update={"api_keys": keys})})
    return cfg
