"""lm-eval's ``local-completions`` against the cluster a user starts (`tandem up -c
configs/local.yaml`, the real SmolLM2 in float32): a small multiple-choice task built here
from local data scores every choice by loglikelihood (``/v1/completions`` with ``echo``,
``logprobs: 1``, ``max_tokens: 1``, several token-id prompts per request), and each
loglikelihood equals the one the engine's runner computes directly on the same tokens.
One question is long enough for a remote prefill, which prompt logprobs must not take."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.api.sampling import SamplingParams
from services.common.config import load_config
from services.engine.batch import ScheduledBatch, ScheduledSeq
from services.engine.factory import build_engine
from tests.support.mock_cluster import MODEL
from tests.support.up import REPO, Up, local_ports, metric, start_up

lm_eval = pytest.importorskip("lm_eval")

FLOAT32 = ["engine.dtype=float32"]
LONG_CONTEXT = ("The Roman Empire built roads, aqueducts and cities across Europe, and its law "
                "shaped later states. ") * 22  # ~400 tokens: past max_local_prefill_length
DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Rome"], "answer": 0},
    {"question": "What colour is the sky on a clear day?", "choices": ["green", "blue"], "answer": 1},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten", "four"],
     "answer": 1},
    {"question": "Which animal says moo?", "choices": ["cat", "dog", "cow"], "answer": 2},
    {"question": LONG_CONTEXT + "Who built the aqueducts?", "choices": ["the Romans", "the Incas"],
     "answer": 0},
]
TASK = """task: tandem_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def cluster(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(frontend base URL, decode worker metrics URL) of a running `tandem up`."""
    ports, overrides = local_ports()
    overrides += FLOAT32
    up: Up = start_up(REPO / "configs" / "local.yaml", tmp_path_factory.mktemp("run"),
                      ["--ready-timeout", "300", "--fail-fast"], overrides)
    base = f"http://127.0.0.1:{ports['front']}"
    try:
        up.wait_healthy(base)
        yield base, f"http://127.0.0.1:{ports['decode_m']}/metrics"
    finally:
        up.stop()


@pytest.fixture(scope="module")
def runner():
    """The engine's own runner on the same model and dtype, in this process."""
    parts = build_engine(load_config(REPO / "configs" / "local.yaml",
                                     ["engine.num_kv_blocks=256", *FLOAT32]))
    return parts.engine.runner


def direct_loglikelihood(runner, context: list[int], continuation: list[int]) -> float:
    """Sum over the continuation of log p(token | every token before it), from the
    runner's logits of each prefix (one prefill per prefix, in its own blocks)."""
    tokens = context + continuation
    bs = runner.block_size
    seqs, nxt = [], 0
    for i in range(len(context), len(tokens)):
        n_blocks = -(-i // bs)
        seqs.append(ScheduledSeq(f"p{i}", tokens[:i], 0, list(range(nxt, nxt + n_blocks)), True,
                                 SamplingParams(temperature=0)))
        nxt += n_blocks
    logp = torch.log_softmax(runner.logits_for(ScheduledBatch(seqs)), dim=-1)  # (n, V)
    return sum(logp[j, tokens[len(context) + j]].item() for j in range(len(seqs)))


def test_lm_eval_local_completions_loglikelihoods_equal_the_engines(
        cluster: tuple[str, str], runner, smollm2_tokenizer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    base, decode_metrics = cluster
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tandem_mc.yaml").write_text(TASK.format(data=data))
    tok_dir = tmp_path / "tokenizer"  # the served model's tokenizer, as transformers loads it
    smollm2_tokenizer.save_hf(tok_dir)

    remote_before = metric(decode_metrics, 'tandem_worker_prefill_total{where="remote"}')
    lm = LocalCompletionsAPI(base_url=base + "/v1/completions", model=MODEL,
                             tokenizer_backend="huggingface", tokenizer=str(tok_dir),
                             batch_size=4, max_retries=1, timeout=300)
    out = simple_evaluate(model=lm, tasks=["tandem_mc"], task_manager=TaskManager(
        include_path=str(tasks)), log_samples=True, random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0)
    assert out is not None
    samples = out["samples"]["tandem_mc"]
    assert len(samples) == len(DOCS)
    checked = 0
    for s in samples:
        for (ctx, cont), resp in zip(s["arguments"], s["resps"], strict=True):
            got = resp[0][0]
            ctx_enc, cont_enc = lm._encode_pair(ctx, cont)
            assert cont_enc, (ctx, cont)
            want = direct_loglikelihood(runner, ctx_enc, cont_enc)
            assert got == pytest.approx(want, abs=2e-3 + 1e-4 * abs(want)), (ctx[-40:], cont)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in DOCS)
    # the model knows these (a sanity check that the numbers mean something)
    assert out["results"]["tandem_mc"]["acc,none"] >= 0.6
    # prompt logprobs prefill on the decode worker: the long question did not go remote
    assert metric(decode_metrics, 'tandem_worker_prefill_total{where="remote"}') == remote_before


def test_echo_max_tokens_zero_through_the_openai_client(cluster: tuple[str, str], runner,
                                                        smollm2_tokenizer) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=cluster[0] + "/v1", api_key="unused", timeout=120)
    prompt = "The capital of France is Paris"
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    (ch,) = r.choices
    ids = smollm2_tokenizer.encode(prompt)
    assert ch.text == prompt and ch.finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 0
    lp = ch.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(ids) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    want = direct_loglikelihood(runner, ids[:1], ids[1:])
    assert sum(lp.token_logprobs[1:]) == pytest.approx(want, abs=2e-3 + 1e-4 * abs(want))


def test_min_p_near_one_samples_the_greedy_text(cluster: tuple[str, str]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=cluster[0] + "/v1", api_key="unused", timeout=120)
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12}
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    free = {client.completions.create(temperature=1.0, seed=s, **kw).choices[0].text
            for s in range(4)}
    assert free != {greedy}  # without min_p, temperature 1 wanders off the greedy text
    for s in range(4):
        r = client.completions.create(temperature=1.0, seed=s, extra_body={"min_p": 0.999}, **kw)
        assert r.choices[0].text == greedy

