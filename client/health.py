"""nmt-health: exit 0 when a server's grpc.health.v1 check says SERVING (the container healthcheck; no extra binaries)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.metadata import version

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-health", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--target", default=os.environ.get("NMT_TARGET", "127.0.0.1:50051"), help="host:port of the server to check, env NMT_TARGET")
    parser.add_argument("--service", default="", help="service to check, e.g. nmt.translation.v1.TranslationService"
                                                       " (default: %(default)r, the whole server)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer before reporting failure")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with grpc.insecure_channel(args.target) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as error:
        sys.stderr.write(f"nmt-health: {args.target}: {error.code().name}\n")
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    sys.stdout.write(f"{args.target}: {status}\n")
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    raise SystemExit(main())
