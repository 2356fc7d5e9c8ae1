"""Every message that crosses a process boundary, defined once, each codec beside its types.

Types: sampling.py (SamplingParams and its bounds), structured.py (StructuredOutput),
outputs.py (TokenOutput, TokenLogprob, FinishReason, Usage), images.py (ImageData,
PromptImage), worker.py (the processor -> decode worker request), processor.py (the
frontend -> processor request and deltas), prefill.py (the prefill queue's job), route.py
(the processor -> router route and updates), embedding.py (the embedding transfer),
kv_events.py (what a worker's prefix cache did), text.py (a check on text that crosses).
Codecs, one per proto: request_codec.py (proto/request.proto), worker_codec.py,
processor_codec.py, prefill_codec.py, route_codec.py, images_codec.py (proto/multimodal.proto),
embedding_codec.py (proto/encode.proto); wire.py is the msgpack of NATS (KV event batches,
dumps, load, in-flight updates) with its types.

Depends on nothing in services/ but the generated protobufs (services/gen): every part can
import it, and a change here is a change to the cluster's contract.
"""
