"""The stages of a request through the processor, in the order ``Processor.generate`` runs
them (one module each, one entry each):

1. ``prompt``: the model name, the chat template (tools rendered), tokens, image
   placeholders widened, the prompt checked against the context.
2. ``sampling``: ``max_tokens`` resolved against the context, token ids and stop strings
   checked.
3. ``route``: the prompt's block hashes, the router's decode worker.
4. ``stream`` (one choice) or ``choices`` (``n`` > 1): the worker's tokens as text deltas
   (detokenizer, stop strings, logprobs as text, usage); ``stream`` moves the request to
   another worker when its own fails (``migrate``).
5. ``tool_calls``: the text read for tool calls, per choice (at most one call with
   ``parallel_tool_calls`` false).
6. ``echo``: completions' echo, the prompt's text and logprobs before each choice's first
   delta.
7. ``ledger``: the request's outcome metrics and its FINISHED report to the router,
   whatever the end was.
"""
