"""Invariant attention with contexts past one split (256 keys): against paged_attention and
float64 by hand, and each row's bits alone vs in the batch. usage: attn_long.py cpu|cuda"""
import sys
import torch
from services.engine.layers import invariant as inv
from services.engine.layers.attention import build_attention_metadata, paged_attention
dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
dt = torch.float32 if dev.type == "cpu" else torch.bfloat16
torch.manual_seed(0)
hq, hkv, hd, bs = 9, 3, 64, 16
nblk = 200
cache = torch.randn(2, nblk, bs, hkv, hd, dtype=dt, device=dev)
prefills = [(500, list(range(0, 40)), 12)]                       # a chunk continuing at 500
decodes = [(700, list(range(40, 90))), (255, list(range(90, 110))), (256, list(range(110, 130))), (3, [130])]
t = 12 + 4
q, k, v = (torch.randn(t, h, hd, dtype=dt, device=dev) for h in (hq, hkv, hkv))
def case(pre, dec, per_token, kernel, qq, kk, vv, c0):
    meta = build_attention_metadata(pre, dec, bs, dev, dt, per_token=per_token)
    c = c0.clone(); return kernel(qq, kk, vv, c, meta), c, meta
ref, rc, _ = case(prefills, decodes, False, paged_attention, q, k, v, cache)
got, gc, meta = case(prefills, decodes, True, inv.invariant_attention, q, k, v, cache)
tr = meta.token_rows
kc = gc[0].reshape(-1, hkv, hd).double().cpu(); vc = gc[1].reshape(-1, hkv, hd).double().cpu()
man = torch.empty(t, hq, hd, dtype=torch.float64)
for r in range(t):
    L = int(tr.ctx_len[r]); row = tr.block_table[r].cpu()
    slots = torch.tensor([int(row[p // bs]) * bs + p % bs for p in range(L)])
    for h in range(hq):
        s = (kc[slots, h // 3] @ q[r, h].double().cpu()) * hd ** -0.5
        man[r, h] = torch.softmax(s, 0) @ vc[slots, h // 3]
print(dt, "ctx", tr.ctx_len.tolist(), "cache eq", torch.equal(rc, gc))
print(" ref err", round((ref.double().cpu() - man).abs().max().item(), 5), "got err", round((got.double().cpu() - man).abs().max().item(), 5))
alone, _, _ = case([], [decodes[0]], True, inv.invariant_attention, q[12:13], k[12:13], v[12:13], gc)
print(" decode@700 alone bit-equal:", torch.equal(alone, got[12:13]))
alone, _, _ = case([(511, list(range(0, 40)), 1)], [], True, inv.invariant_attention, q[11:12], k[11:12], v[11:12], gc)
print(" chunk's last token alone bit-equal:", torch.equal(alone, got[11:12]))
