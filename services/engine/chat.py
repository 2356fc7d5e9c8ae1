"""`tandem chat`: talk to one in-process engine from the terminal.

The whole cluster (`tandem up`) is the real way to serve; this is the smallest way to see
the engine answer, and what `make run` falls back to before the cluster exists.
"""

from __future__ import annotations

import argparse
import sys
import uuid

from services.api.sampling import SamplingParams
from services.common.config import load_config
from services.engine.engine import LLMEngine
from services.engine.factory import build_engine
from services.engine.request import GenerateRequest
from services.model.tokenizer import Tokenizer


def stream_reply(
    engine: LLMEngine, tokenizer: Tokenizer, messages: list[dict[str, str]], sampling: SamplingParams
):
    """Yield text pieces of the assistant's reply as the engine produces tokens."""
    prompt = tokenizer.encode_chat(messages)
    rid = uuid.uuid4().hex
    request = GenerateRequest(rid, prompt, sampling)
    engine.validate(request)  # the entry: the engine itself trusts its callers
    engine.add_request(request)
    ids: list[int] = []
    emitted = ""
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            ids.extend(out.token_ids)
            text = tokenizer.decode(ids)
            # NOTE: a multi-byte character split across tokens decodes to U+FFFD until its
            # last byte arrives; hold it back rather than print a replacement character.
            if not out.finished and text.endswith("\ufffd"):
                continue
            if len(text) > len(emitted):
                yield text[len(emitted) :]
            emitted = text


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    print("loading the model ...", file=sys.stderr, flush=True)
    parts = build_engine(cfg)
    if parts.tokenizer is None:
        print("tandem chat needs a tokenizer: run `tandem model pull`", file=sys.stderr)
        return 2
    sampling = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        stop_token_ids=parts.tokenizer.stop_token_ids,
    )
    history: list[dict[str, str]] = []
    interactive = args.prompt is None and sys.stdin.isatty()
    if interactive:
        print(f"{parts.model_name} ready. Type a message (Ctrl-D to quit).", file=sys.stderr)
    prompts = [args.prompt] if args.prompt is not None else _read_lines(interactive)
    for line in prompts:
        history.append({"role": "user", "content": line})
        reply = []
        for piece in stream_reply(parts.engine, parts.tokenizer, history, sampling):
            reply.append(piece)
            print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _read_lines(interactive: bool):
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return
        if line.strip():
            yield line
