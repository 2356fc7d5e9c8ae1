"""CUDA check of the overlapped loop's mask fill: 64 requests under JSON schemas, sampled
at temperature 1 (wide exploration of grammar states) beside 16 free ones; every
constrained answer must be accepted token by token by a fresh matcher, none may end in a
grammar error, and each step's fill must have started on the filler thread when overlapped.
usage: check_grammar.py MODEL_DIR DEVICE"""
import os, sys, time
sys.path.insert(0, os.getcwd())
from services.api.outputs import FinishReason
from services.api.sampling import SamplingParams
from services.api.structured import StructuredOutput
from services.bench.engine import bench_schema
from services.common.config import load_config
from services.engine.factory import build_engine
from services.engine.request import GenerateRequest

model, device = sys.argv[1], sys.argv[2]
SCHEMA = {"type": "object", "required": ["name", "age", "tags"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}
for overlap in ("true", "false"):
    cfg = load_config("configs/local.yaml", [f"model.path={model}", f"engine.device={device}",
                      "engine.quantization=int4", f"engine.overlap={overlap}", "engine.max_num_seqs=80",
                      "engine.num_kv_blocks=2048"])
    eng = build_engine(cfg).engine
    specs = [StructuredOutput.json_schema(SCHEMA), bench_schema(40)]
    reqs = []
    for i in range(80):
        so = specs[i % 2] if i < 64 else None
        sp = SamplingParams(temperature=1.0, seed=i, max_tokens=96, structured=so)
        reqs.append(GenerateRequest(f"r{i}", [1] + list(range(300 + i, 340 + i)), sp))
    for r in reqs:
        eng.validate(r); eng.add_request(r)
    toks = {r.request_id: [] for r in reqs}
    reasons = {}
    t0 = time.perf_counter()
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id].extend(o.token_ids)
            if o.finished:
                reasons[o.request_id] = (o.finish_reason, o.error)
    dt = time.perf_counter() - t0
    eng.check_integrity()
    assert eng.pool.num_used == 0
    errors = [(k, v) for k, v in reasons.items() if v[0] is FinishReason.ERROR]
    comp = eng.grammar
    bad = 0
    for r in reqs[:64]:
        st = comp.start(r.sampling.structured)
        for t in toks[r.request_id]:
            if st.advance(t) is not None:
                bad += 1; break
    filler = getattr(eng, "_filler", None)
    print(f"overlap={overlap} overlapped={eng.overlap}: {len(reasons)} finished in {dt:.2f}s, "
          f"grammar errors {len(errors)} {errors[:2]}, replay refusals {bad}, "
          f"stops {sum(v[0] is FinishReason.STOP for v in reasons.values())}, filler={'yes' if filler else 'no'}, "
          f"wait total {comp.stats.mask_wait_seconds.total*1e3 if hasattr(comp.stats, 'mask_wait_seconds') else -1:.1f} ms",
          flush=True)
    assert not errors and not bad
    if eng.overlap:
        assert filler is not None
print("CHECK OK")
