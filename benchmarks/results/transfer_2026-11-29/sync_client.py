"""bare_stream.py's server, with a sync grpcio client (optionally SingleThreadedUnaryStream)."""
import os, sys, time, multiprocessing as mp
import grpc, grpc.experimental
from services.common.malloc_tuning import tune_malloc
tune_malloc()
sys.path.insert(0, os.path.dirname(__file__))
from bare_stream import server, opts, SVC  # ../transfer_2026-11-28/bare_stream.py, copied beside

def client(port):
    o = opts()
    if os.environ.get("SINGLE"):
        o.append((grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1))
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=o)
    call = ch.unary_stream(SVC, request_serializer=None, response_deserializer=None)
    buf = bytearray(400 << 20)
    mv = memoryview(buf)
    for size in [int(x) for x in os.environ.get("SIZES", "9437184,37748736,150994944").split(",")]:
        rates = []
        for rep in range(7):
            t = time.perf_counter(); pos = 0
            for m in call(str(size).encode()):
                mv[pos:pos + len(m)] = m; pos += len(m)
            dt = time.perf_counter() - t
            assert pos == size
            if rep: rates.append(size / dt / 1e9)
        rates.sort()
        print(f"{size/1e6:7.1f} MB  median {rates[len(rates)//2]:.2f}  min {rates[0]:.2f} max {rates[-1]:.2f}", flush=True)
    ch.close()

if __name__ == "__main__":
    q = mp.Queue()
    p = mp.Process(target=server, args=(q,), daemon=True); p.start()
    port = q.get()
    client(port)
    p.kill()
