"""`tandem router -c FILE [--set k=v] [--replica N]`: run one router replica."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.common.config import ConfigError, load_config


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    from services.router.grpc_server import serve

    asyncio.run(serve(cfg, replica=args.replica))
    return 0
