"""Moving a request between engines (docs/reliability.md "Moving requests on scale-down"):
``hold_for_move`` holds a running request's blocks and aborts the rest, ``export_held``
copies exactly the blocks asked for, and the target parks the request without its last
token and imports them: it goes on with the tokens of an unmoved run."""

from __future__ import annotations

import pytest
import torch

from services.decode.move_in import resumed_request
from services.engine.move import MoveRefused
from services.engine.request import GenerateRequest
from services.engine.sequence import SeqStatus
from tests.support.engine_factory import make_engine, mock_cfg, oracle, req, run_all

PROMPT = list(range(100, 110))  # 10 tokens: blocks of 4 -> 0, 1 full, 2 holds 2


def _step_until(engine, rid: str, n: int) -> list[int]:
    got: list[int] = []
    while len(got) < n:
        for o in engine.step():
            if o.request_id == rid:
                got += o.token_ids
    return got


@pytest.mark.parametrize("overlap", [False, True])
def test_hold_export_and_import_continue_the_unmoved_run(overlap: bool) -> None:
    cfg = mock_cfg(max_num_seqs=1).model_copy(update={"overlap": overlap})
    src, runner, _ = make_engine(cfg, "src")
    a = req("a", PROMPT, max_tokens=12)
    want, _ = oracle(src, runner, a)
    src.add_request(a)
    src.add_request(req("b", PROMPT[:5], max_tokens=3))  # waits: one seat
    produced = _step_until(src, "a", 4)
    hold = src.hold_for_move()
    produced += [t for o in hold.outputs if o.request_id == "a" for t in o.token_ids]
    assert produced == want[:len(produced)]
    (held,) = hold.held
    n = len(PROMPT) + len(produced) - 1  # the last token's KV is not computed yet
    assert (held.request_id, held.num_tokens, held.num_blocks) == ("a", n, -(-n // 4))
    assert hold.handed_back == ["b"]
    assert src.scheduler.seqs["a"].status is SeqStatus.HELD and not src.has_schedulable()
    src.check_integrity()
    with pytest.raises(MoveRefused):
        src.export_held("a", 0, held.num_blocks, n + 1)
    with pytest.raises(KeyError):
        src.export_held("b", 0, 1, 4)

    # The target: a replay-shaped request, parked without its last token.
    replay = GenerateRequest("a", PROMPT + produced, req("a", [], max_tokens=12 - len(produced),
                                                       seed_step_offset=len(produced)).sampling)
    dst, _, _ = make_engine(mock_cfg(), "dst")
    handle = dst.begin_remote_prefill(resumed_request(replay))
    assert handle is not None and handle.first_block_to_fill == 0
    kv, last = src.export_held("a", 0, handle.num_blocks_to_fill, n)
    assert last == produced[-1]
    src.abort("a")
    src.check_integrity()
    assert src.stats().kv_blocks_used == 0
    out = dst.complete_remote_prefill("a", kv, last)
    assert out is not None and out.token_ids == [last] and not out.finished
    blocks = dst.scheduler.seqs["a"].block_table[:handle.num_blocks_to_fill]
    assert torch.equal(dst.runner.export_kv(blocks), kv)
    assert run_all(dst)["a"] == want[len(produced):]
    assert dst.stats().kv_blocks_used == 0
