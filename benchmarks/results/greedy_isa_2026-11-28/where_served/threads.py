"""Per-thread CPU of every python/tandem process over a window: threads.py DELAY WINDOW"""
import os, sys, time
def snap():
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try:
            cmd = open(f"/proc/{pid}/cmdline","rb").read().replace(b"\0",b" ").decode()[:120]
        except OSError: continue
        if "python" not in cmd and "tandem" not in cmd: continue
        try: tids = os.listdir(f"/proc/{pid}/task")
        except OSError: continue
        for tid in tids:
            try:
                st = open(f"/proc/{pid}/task/{tid}/stat").read()
                comm = st[st.index("(")+1:st.rindex(")")]
                f = st[st.rindex(")")+2:].split()
                out[(pid, tid)] = (cmd, comm, int(f[11]) + int(f[12]), int(f[12]))
            except OSError: pass
    return out
def report(a, b, dt):
    hz = os.sysconf("SC_CLK_TCK"); rows = []
    for k, (cmd, comm, t, _s) in b.items():
        if k in a:
            d = (t - a[k][2]) / hz / dt
            sy = (b[k][3] - a[k][3]) / hz / dt
            if d > 0.005: rows.append((d, k[0] + "/" + k[1] + f" sys {sy*100:4.1f}%", comm, cmd))
    for d, pid, comm, cmd in sorted(rows, reverse=True):
        print(f"{d*100:6.1f}%  {pid:>22} {comm:16} {cmd[:70]}")
    print(f"total {sum(r[0] for r in rows)*100:.1f}%")

if __name__ == "__main__":
    iv, dur, win = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    snaps = []
    t_end = time.time() + dur
    while time.time() < t_end:
        snaps.append((time.time(), snap())); time.sleep(iv)
    def tot(a, b):
        return sum(b[k][2] - a[k][2] for k in b if k in a)
    best = max(range(len(snaps) - win), key=lambda i: tot(snaps[i][1], snaps[i + win][1]))
    (t0, a), (t1, b) = snaps[best], snaps[best + win]
    print(f"window {best*iv:.0f}..{(best+win)*iv:.0f} s")
    report(a, b, t1 - t0)
