"""Every benchmark of tandem, one module per `tandem bench NAME` (docs/benchmarks.md):

- engine.py       `bench engine`: engine prefill/decode tokens/s, fp32 matmul GFLOP/s
- router.py       `bench router`: route latency over a large index, event ingest rate
- kv_transfer.py  `bench kv-transfer`: KV transfer GB/s, gRPC bytes and /dev/shm, beside a memcpy
- serve.py        `bench serve`: a workload against any OpenAI-compatible endpoint
- compare.py      `bench compare`: one workload against several clusters (presets.py: the
                  documented tables' runs and workloads)
- overhead.py     `bench overhead`: time to first token at each layer, CPU per request
- anchor.py       `bench anchor`: tandem beside llama.cpp's llama-server, same GGUF and threads
- report.py       `bench report`: markdown rows and CDF plots from compare results

Shared: args.py (every parser), results.py (command line, machine info, JSON writing),
cluster.py (`tandem up` as a subprocess), and the serving parts workloads.py,
arrivals.py, client.py, metrics.py, plots.py.
"""
