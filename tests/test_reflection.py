"""Server reflection against a real server on loopback, through grpc_reflection's own client: every service listed under
grpc.reflection.v1alpha and grpc.reflection.v1 is described, as grpcurl list / describe do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.api.auth import REFLECTION_V1
from nmt_serve.server.api.reflection import V1_FILE, v1_file
from nmt_serve.server.api.service import SERVICE_NAME
from tests.serving import RunningServer, server_settings

VERSIONS = {"v1alpha": reflection.SERVICE_NAME, "v1": REFLECTION_V1}


@pytest.fixture(scope="module")
def running(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with RunningServer(server_settings(tiny_model_dir)) as server:
        yield server


class ReflectionStub:
    """ServerReflectionStub for either service name: grpc_reflection's client speaks v1alpha only, and v1's messages are
    v1alpha's on the wire."""

    def __init__(self, channel: grpc.Channel, service: str) -> None:
        self.ServerReflectionInfo = channel.stream_stream(f"/{service}/ServerReflectionInfo",
                                                          request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                                          response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)  # fmt: skip


def reflection_client(channel: grpc.Channel, service: str) -> ProtoReflectionDescriptorDatabase:
    database = ProtoReflectionDescriptorDatabase(channel)
    database._stub = ReflectionStub(channel, service)  # the client's only use of the channel
    return database


def signatures(service: object) -> dict[str, tuple[str, str]]:
    return {method.name: (method.input_type.full_name, method.output_type.full_name) for method in service.methods}  # type: ignore[attr-defined]


@pytest.mark.parametrize("version", VERSIONS)
def test_reflection_lists_and_describes_every_service(running: RunningServer, version: str) -> None:
    with grpc.insecure_channel(running.target) as channel:
        database = reflection_client(channel, VERSIONS[version])
        listed = database.get_services()
        assert sorted(listed) == sorted((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1))
        pool = descriptor_pool.DescriptorPool(database)
        described = {name: signatures(pool.FindServiceByName(name)) for name in listed}
    assert described[SERVICE_NAME] == signatures(pb.DESCRIPTOR.services_by_name["TranslationService"])
    assert described[health.SERVICE_NAME] == signatures(health_pb2.DESCRIPTOR.services_by_name["Health"])
    assert described[reflection.SERVICE_NAME] == {"ServerReflectionInfo": ("grpc.reflection.v1alpha.ServerReflectionRequest",
                                                                           "grpc.reflection.v1alpha.ServerReflectionResponse")}  # fmt: skip
    assert described[REFLECTION_V1] == {"ServerReflectionInfo": ("grpc.reflection.v1.ServerReflectionRequest", "grpc.reflection.v1.ServerReflectionResponse")}
    assert pool.FindServiceByName(REFLECTION_V1).file.name == V1_FILE


def test_reflection_v1_messages_are_v1alphas_field_for_field() -> None:
    """What lets one servicer answer both names: the same fields, numbers and types under the other package."""

    def fields(file: object) -> dict[str, list[tuple]]:
        return {name: [(field.name, field.number, field.type, field.message_type and field.message_type.name) for field in message.fields]
                for name, message in file.message_types_by_name.items()}  # type: ignore[attr-defined]  # fmt: skip

    v1 = v1_file()
    assert v1.package == "grpc.reflection.v1" and v1_file() is v1  # added to the default pool once
    assert fields(v1) == fields(reflection_pb2.DESCRIPTOR) and len(fields(v1)) == 8
