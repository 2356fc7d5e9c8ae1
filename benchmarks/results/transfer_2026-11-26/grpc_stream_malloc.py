import asyncio, sys, time, os, resource, multiprocessing as mp
import grpc
if os.environ.get("MALLOPT"):
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    m=os.environ["MALLOPT"].split(":"); print("mallopt", [libc.mallopt(int(k), int(v)) for k,v in (x.split("=") for x in m)], file=sys.stderr)
N = int(os.environ.get("NB", 377_000_000))
CH = int(os.environ.get("CH", 1<<20))
OPTS = [("grpc.max_receive_message_length", 64<<20), ("grpc.max_send_message_length", 64<<20)]
extra = os.environ.get("OPT", "")
for kv in filter(None, extra.split(",")):
    k, v = kv.split("="); OPTS.append((k, int(v)))
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
def server(q):
    async def run():
        async def h(it, ctx):
            c0 = cpu(); n = 0
            async for m in it:
                n += len(m)
            return int((cpu()-c0)*1e6).to_bytes(8, "little")
        srv = grpc.aio.server(options=OPTS)
        srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("x.X", {"T": grpc.stream_unary_rpc_method_handler(h)})])
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start(); q.put(port)
        await srv.wait_for_termination()
    asyncio.run(run())
async def client(port):
    data = os.urandom(1<<20) * (N >> 20)
    mv = memoryview(data)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTS)
    call = ch.stream_unary("/x.X/T")
    def gen():
        for o in range(0, len(data), CH):
            yield bytes(mv[o:o+CH])
    res = []
    for rep in range(int(os.environ.get("REPS", 6))):
        c0 = cpu(); t0 = time.perf_counter()
        r = await call(gen())
        dt = time.perf_counter() - t0; cc = cpu() - c0; sc = int.from_bytes(r, "little")/1e6
        res.append((len(data)/dt/1e9, cc/len(data)*1e9, sc/len(data)*1e9))
    res = res[1:]
    import statistics as st
    print(f"{os.environ.get('GRPC_EXPERIMENTS','')} CH={CH>>10}K {extra}: GB/s med {st.median(r[0] for r in res):.2f} max {max(r[0] for r in res):.2f} | client cpu s/GB {st.median(r[1] for r in res):.3f} server cpu s/GB {st.median(r[2] for r in res):.3f}", flush=True)
if __name__ == "__main__":
    q = mp.Queue(); p = mp.Process(target=server, args=(q,), daemon=True); p.start()
    asyncio.run(client(q.get()))
    p.kill()
