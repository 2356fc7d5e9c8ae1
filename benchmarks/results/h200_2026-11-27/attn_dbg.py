import torch, sys
from services.engine.layers import invariant as inv
from services.engine.layers.attention import build_attention_metadata, paged_attention
dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
for dt in (torch.float32, torch.bfloat16):
    torch.manual_seed(0)
    hq, hkv, hd, bs = 9, 3, 64, 4
    cache = torch.randn(2, 96, bs, hkv, hd, dtype=dt, device=dev)
    prefills = [(0, list(range(0, 8)), 9), (5, list(range(8, 16)), 6)]
    decodes = [(3, list(range(16, 20))), (10, list(range(20, 24))), (0, [30])]
    t = 18
    q, k, v = (torch.randn(t, h, hd, dtype=dt, device=dev) for h in (hq, hkv, hkv))
    def case(per_token, kernel):
        meta = build_attention_metadata(prefills, decodes, bs, dev, dtype=dt, per_token=per_token)
        c = cache.clone(); return kernel(q, k, v, c, meta), c, meta
    ref, rc, _ = case(False, paged_attention)
    got, gc, meta = case(True, inv.invariant_attention)
    # float64 by hand from the written cache
    tr = meta.token_rows; man = torch.empty(t, hq, hd, dtype=torch.float64)
    kc = gc[0].reshape(-1, hkv, hd).double().cpu(); vc = gc[1].reshape(-1, hkv, hd).double().cpu()
    table = tr.block_table.cpu(); ctx = tr.ctx_len.cpu()
    for r in range(t):
        L = int(ctx[r]); slots = [int(table[r, p // bs]) * bs + p % bs for p in range(L)]
        for h in range(hq):
            kk = kc[slots, h // 3]; vv = vc[slots, h // 3]
            s = (kk @ q[r, h].double().cpu()) * hd ** -0.5
            man[r, h] = torch.softmax(s, 0) @ vv
    e_ref = (ref.double().cpu() - man).abs().amax(dim=(2,)); e_got = (got.double().cpu() - man).abs().amax(dim=(2,))
    print(dt, "cache eq", torch.equal(rc, gc), "ctx", ctx.tolist())
    print(" ref err per row", [round(x, 4) for x in e_ref.amax(1).tolist()])
    print(" got err per row", [round(x, 4) for x in e_got.amax(1).tolist()])
    print(" got err row/head>0.05", [(r, h) for r in range(t) for h in range(hq) if e_got[r, h] > 0.05][:20])
