"""A gRPC server that answers every Translate call RESOURCE_EXHAUSTED at once and does nothing else: grpcio's own cost of a refusal.

nmt-burst-report sends the same bursts to it as to nmt-serve. What it measures is the floor any server built on
grpcio's asyncio API meets on the host: one handler run, one status written per call, no interceptor, no model.
Run: python -m nmt_serve.bench.refusing_server --port-file FILE (port 0: a free one, written to FILE once serving).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

import grpc

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.protos.nmt.translation.v1 import translation_pb2_grpc as pb_grpc

logger = logging.getLogger("refusing-server")


class RefuseEverything(pb_grpc.TranslationServiceServicer):
    async def Translate(self, request: pb.TranslateRequest, context: grpc.aio.ServicerContext) -> pb.TranslateResponse:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "refused: this server refuses every call")


async def serve(host: str, port: int, port_file: Path | None) -> None:
    server = grpc.aio.server()
    pb_grpc.add_TranslationServiceServicer_to_server(RefuseEverything(), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    if port_file is not None:
        port_file.write_text(str(bound))
    logger.info("refusing every call on %s:%d", host, bound)
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="refusing-server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", type=Path, default=None)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.host, args.port, args.port_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
