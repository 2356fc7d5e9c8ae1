import collections, sys
rows = [l.rsplit(" ", 1) for l in open(sys.argv[1]).read().splitlines()]
tot = 0; leaf = collections.Counter(); incl = collections.Counter()
for st, n in rows:
    n = int(n); parts = [p.split(" (")[0] for p in st.split(";")]
    tot += n; leaf[parts[-1]] += n
    for x in set(parts): incl[x] += n
print("samples", tot)
print("SELF:", "; ".join(f"{k} {100*v/tot:.0f}%" for k, v in leaf.most_common(12)))
print("INCL:", "; ".join(f"{k} {100*v/tot:.0f}%" for k, v in incl.most_common(30)))
