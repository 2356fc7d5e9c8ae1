"""`tandem bench anchor`: its ratio table, the batch-1 floor's pieces, how it finds
llama-server, and its llama-server phase end to end against a stand-in server
(tests/support/fake_llama_server.py); the tandem phases are `bench engine`'s measurement
and `tandem up`, tested where those live."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from services.bench import anchor
from services.cli import build_parser, main
from tests.support.ports import free_port

FAKE = Path(__file__).parents[2] / "support" / "fake_llama_server.py"


def _loads(**kw: int) -> anchor.Loads:
    base = dict(prefill_len=850, decode_context=32, decode_tokens=128, itl_prompt=190, itl_out=64,
                itl_requests=8, streams=32, stream_requests=64, repeats=3, seed=0)
    return anchor.Loads(**{**base, **kw})


def test_ratio_rows_judge_throughputs_up_and_latencies_down() -> None:
    llama = {"prefill_tok_s": 300.0, "decode_tok_s": 60.0, "itl_ms_1": 20.0, "out_tok_s_n": 80.0,
             "ttft_ms_n": 1000.0}
    tandem = {"prefill_tok_s": 600.0, "decode_tok_s": 96.0, "itl_ms_1": 25.0, "out_tok_s_n": 200.0,
              "ttft_ms_n": 500.0}
    rows = {r["key"]: r for r in anchor.ratio_rows(llama, tandem, _loads())}
    assert rows["prefill_tok_s"]["ratio"] == 2.0 and rows["prefill_tok_s"]["meets"] is False  # >= 3x
    assert rows["decode_tok_s"]["ratio"] == 1.6 and rows["decode_tok_s"]["meets"] is True  # >= 1.5x
    assert rows["itl_ms_1"]["ratio"] == 1.25 and rows["itl_ms_1"]["meets"] is False  # <= 1x
    assert rows["out_tok_s_n"]["meets"] is True and rows["ttft_ms_n"]["meets"] is True
    assert "850-token" in rows["prefill_tok_s"]["label"] and "32 streams" in rows["out_tok_s_n"]["label"]
    # a side that was not run: no ratio, no verdict, and the table still prints
    missing = anchor.ratio_rows(llama, {}, _loads())
    assert all(r["ratio"] is None and r["meets"] is None for r in missing)
    assert "llama-server" in anchor.format_table(missing, {"threads": 2, "bandwidth_gbs": 10.0})


def test_served_itl_is_put_over_the_workers_own_decode_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from services.engine.stats_metrics import EngineStatsCollector
    from services.engine.timings import StepKind
    from tests.support.engine_factory import make_engine, req

    eng = make_engine()[0]
    eng.add_request(req("a", list(range(10, 20)), max_tokens=4))
    while eng.has_unfinished():
        eng.step()
    # a prompt arriving beside a decoding one: a step with prefill tokens and decodes
    eng.add_request(req("b", list(range(30, 40)), max_tokens=3))
    eng.step()
    eng.add_request(req("c", list(range(50, 60)), max_tokens=2))
    while eng.has_unfinished():
        eng.step()
    reg = CollectorRegistry()
    reg.register(EngineStatsCollector(eng.stats))
    body = generate_latest(reg).decode()
    monkeypatch.setattr(anchor.httpx, "get", lambda url, timeout: SimpleNamespace(text=body))
    got = anchor.step_seconds("http://worker/metrics")
    timings = eng.stats().timings
    for kind in StepKind:
        hist = timings.step_seconds[kind]
        assert got[kind.name.lower()] == (pytest.approx(hist.total), hist.count), kind
    assert got["mixed"][1] >= 1 and got["decode"][1] >= 3

    rows = anchor.ratio_rows({"itl_ms_1": 10.0}, {"itl_ms_1": 44.0}, _loads())
    table = anchor.format_table(rows, {"threads": 2, "bandwidth_gbs": 10.0}, step_ms=40.0)
    assert "served ITL 44.0 ms over its worker's decode step 40.0 ms: the served path adds +10.0%" in table
    assert "served path" not in anchor.format_table(rows, {"threads": 2, "bandwidth_gbs": 10.0})


def test_slot_context_fits_the_longest_load() -> None:
    assert _loads().slot_context() == 1024  # 851 + margin, rounded up to 256
    assert _loads(prefill_len=8, itl_prompt=300, itl_out=100).slot_context() == 512


def test_decode_read_bytes_counts_what_a_batch_1_step_reads() -> None:
    class Quantized(nn.Module):  # as services/engine/quant: packed buffers, a dense copy aside
        def __init__(self) -> None:
            super().__init__()
            self.matmul = nn.Module()
            self.matmul.register_buffer("packed", torch.zeros(4, 2, dtype=torch.uint8), persistent=False)
            self.matmul.register_buffer("scale", torch.zeros(4), persistent=False)
            self.dense = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    class M(nn.Module):
        def __init__(self, quantized_head: bool) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.lm_head_weight = self.embed.weight  # tied, as SmolLM2's
            self.lm_head = Quantized() if quantized_head else None
            self.proj = nn.Linear(4, 4, bias=False)
            self.q = Quantized()
            self.rotary = nn.Module()
            self.rotary.register_buffer("cos_cache", torch.zeros(1000, 4))

    proj, quantized = 4 * 4 * 4, 8 + 4 * 4
    assert anchor.decode_read_bytes(M(False)) == 10 * 4 * 4 + proj + quantized  # the head: the table
    assert anchor.decode_read_bytes(M(True)) == proj + 2 * quantized  # the table: one row, not counted
    assert anchor.floor_tok_s(10.0, 100 * 10**6) == pytest.approx(100.0)
    assert anchor.floor_tok_s(10.0, 0) == 0.0


def test_llama_server_argv_has_the_same_threads_and_one_slot_per_stream() -> None:
    argv = anchor.llama_server_argv(Path("/bin/ls"), Path("m.gguf"), 2, 9, 32, 1024, "M", ["-fa", "on"])
    assert argv[argv.index("-t") + 1] == "2" and argv[argv.index("-tb") + 1] == "2"
    assert argv[argv.index("--parallel") + 1] == "32" and argv[argv.index("-c") + 1] == str(32 * 1024)
    assert argv[argv.index("-ngl") + 1] == "0" and argv[-2:] == ["-fa", "on"]


def test_find_llama_server_flag_then_env_then_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv(anchor.LLAMA_SERVER_ENV, raising=False)
    assert anchor.find_llama_server(None) is None
    assert anchor.find_llama_server(str(exe)) == exe
    assert anchor.find_llama_server(str(tmp_path / "nope")) is None
    monkeypatch.setenv(anchor.LLAMA_SERVER_ENV, str(exe))
    assert anchor.find_llama_server(None) == exe
    monkeypatch.delenv(anchor.LLAMA_SERVER_ENV)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert anchor.find_llama_server(None) == exe


def test_missing_llama_server_prints_how_to_get_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(anchor.LLAMA_SERVER_ENV, raising=False)
    assert main(["bench", "anchor", "--phases", "llama"]) == 2
    assert "build_llama_server.sh" in capsys.readouterr().err


def test_bad_phase_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "anchor", "--phases", "llama,gpu"]) == 2
    assert "--phases" in capsys.readouterr().err


def test_anchor_parser_defaults_are_the_issue_loads() -> None:
    args = build_parser().parse_args(["bench", "anchor"])
    assert (args.threads, args.prefill_len, args.itl_prompt, args.itl_out, args.streams) == (2, 850, 190, 64, 32)


def test_llama_phase_end_to_end_against_a_stand_in(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"\0" * 4000)
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    exe.chmod(0o755)
    argv_file = tmp_path / "argv.json"
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(argv_file))
    out = tmp_path / "anchor.json"
    rc = main(["bench", "anchor", "--phases", "llama", "--llama-server", str(exe),
               "--llama-port", str(free_port()), "--set", f"model.path={gguf}",
               "--run-dir", str(tmp_path / "run"), "--bandwidth-mib", "4", "--threads", "1",
               "--prefill-len", "16", "--decode-tokens", "4", "--itl-prompt", "8", "--itl-out", "5",
               "--itl-requests", "2", "--streams", "3", "--stream-requests", "4", "--repeats", "1",
               "--json", str(out), "--ready-timeout", "60"])
    assert rc == 0
    res = json.loads(out.read_text())
    llama = res["llama"]
    assert (llama["prefill_tok_s"], llama["decode_tok_s"]) == (321.0, 61.0)  # its own timings
    assert llama["out_tok_s_n"] > 0 and llama["itl_ms_1"] >= 0 and llama["ttft_ms_n"] > 0
    assert llama["weight_bytes"] == 4000 and res["floor"]["llama"]["floor_tok_s"] > 0
    assert res["tandem"] == {} and all(r["ratio"] is None for r in res["rows"])
    started = json.loads(argv_file.read_text())
    assert started[started.index("-m") + 1] == str(gguf) and started[started.index("-t") + 1] == "1"
    assert started[started.index("--parallel") + 1] == "3"
    assert res["command"].startswith("tandem bench anchor")
