"""`tandem router -c FILE [--set k=v] [--replica N]`: run one router replica."""

from __future__ import annotations

import argparse

from services.common.config import ClusterConfig
from services.common.service import run_part


async def _serve(cfg: ClusterConfig, replica: int) -> None:
    from services.router.grpc_server import serve

    await serve(cfg, replica=replica)


def main(args: argparse.Namespace) -> int:
    return run_part(args, _serve)
