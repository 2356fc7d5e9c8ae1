import asyncio, os, sys, time, multiprocessing as mp
import grpc
from services.common.malloc_tuning import tune_malloc
tune_malloc()

SVC = "/t.T/Pull"
PIECE = int(os.environ.get("PIECE", 1 << 20))

def opts():
    o = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    la = os.environ.get("LOOKAHEAD")
    if la: o.append(("grpc.http2.lookahead_bytes", int(la)))
    if os.environ.get("NOBDP"): o.append(("grpc.http2.bdp_probe", 0))
    return o

def server(port_q):
    async def main():
        payload = memoryview(bytes(400 << 20))
        async def pull(req, ctx):
            n = int(req)
            for off in range(0, n, PIECE):
                yield bytes(payload[off:min(off + PIECE, n)])
        h = grpc.method_handlers_generic_handler("t.T", {"Pull": grpc.unary_stream_rpc_method_handler(pull, request_deserializer=None, response_serializer=None)})
        s = grpc.aio.server(options=opts())
        s.add_generic_rpc_handlers((h,))
        port = s.add_insecure_port("127.0.0.1:0")
        await s.start()
        port_q.put(port)
        await s.wait_for_termination()
    asyncio.run(main())

async def client(port):
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts())
    call = ch.unary_stream(SVC, request_serializer=None, response_deserializer=None)
    buf = bytearray(400 << 20)
    mv = memoryview(buf)
    for size in [int(x) for x in os.environ.get("SIZES", "9437184,37748736,150994944").split(",")]:
        rates = []
        for rep in range(7):
            t = time.perf_counter(); pos = 0
            async for m in call(str(size).encode()):
                mv[pos:pos + len(m)] = m; pos += len(m)
            dt = time.perf_counter() - t
            assert pos == size
            if rep: rates.append(size / dt / 1e9)
        rates.sort()
        print(f"{size/1e6:7.1f} MB  median {rates[len(rates)//2]:.2f}  min {rates[0]:.2f} max {rates[-1]:.2f}", flush=True)
    await ch.close()

if __name__ == "__main__":
    q = mp.Queue()
    p = mp.Process(target=server, args=(q,), daemon=True); p.start()
    port = q.get()
    asyncio.run(client(port))
    p.kill()
