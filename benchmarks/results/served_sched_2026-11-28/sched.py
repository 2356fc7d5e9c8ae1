"""Per-thread run / run-queue wait / blocked time of every python process over the busiest
window: sched.py INTERVAL DURATION WINDOW. From /proc/PID/task/TID/schedstat (ns on CPU,
ns runnable but waiting for a CPU) and status (voluntary / involuntary switches)."""
import os
import sys
import time


def snap() -> dict:
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:110]
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        if "python" not in cmd and "tandem" not in cmd:
            continue
        for tid in tids:
            try:
                run, wait, _ = (int(x) for x in open(f"/proc/{pid}/task/{tid}/schedstat").read().split())
                st = open(f"/proc/{pid}/task/{tid}/stat").read()
                comm = st[st.index("(") + 1:st.rindex(")")]
                vol = inv = 0
                for line in open(f"/proc/{pid}/task/{tid}/status"):
                    if line.startswith("voluntary_ctxt_switches"):
                        vol = int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        inv = int(line.split()[1])
                out[(pid, tid)] = (cmd, comm, run, wait, vol, inv)
            except (OSError, ValueError):
                pass
    return out


def main() -> None:
    iv, dur, win = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    snaps = []
    end = time.time() + dur
    while time.time() < end:
        snaps.append((time.time(), snap()))
        time.sleep(iv)

    def busy(a: dict, b: dict) -> int:
        return sum(b[k][2] - a[k][2] for k in b if k in a)

    best = max(range(len(snaps) - win), key=lambda i: busy(snaps[i][1], snaps[i + win][1]))
    (t0, a), (t1, b) = snaps[best], snaps[best + win]
    dt = (t1 - t0) * 1e9
    print(f"window {best * iv:.0f}..{(best + win) * iv:.0f} s; % of the window: run, run-queue wait,"
          " other (blocked or asleep); switches/s voluntary, involuntary")
    rows = []
    for k, (cmd, comm, run, wait, vol, inv) in b.items():
        if k not in a:
            continue
        r, w = (run - a[k][2]) / dt, (wait - a[k][3]) / dt
        if r < 0.005:
            continue
        s = (t1 - t0)
        rows.append((r, w, (vol - a[k][4]) / s, (inv - a[k][5]) / s, f"{k[0]}/{k[1]}", comm, cmd))
    for r, w, v, i, ids, comm, cmd in sorted(rows, reverse=True):
        print(f"{r*100:6.1f} {w*100:6.1f} {max(0.0, 1-r-w)*100:6.1f}  {v:7.0f} {i:6.0f}  {ids:>12} {comm:16} {cmd[:60]}")
    print(f"total run {sum(x[0] for x in rows)*100:.1f}%, wait {sum(x[1] for x in rows)*100:.1f}%")


if __name__ == "__main__":
    main()
