"""The processor part: chat template, tokenization, routing, streaming from a decode
worker, incremental detokenization, stop strings and usage (processor.py runs a request
through the stages in stages/)."""
