"""gRPC server reflection under both names clients ask for, v1alpha and v1, each able to describe every listed service."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor, descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from nmt_serve.server.api.auth import REFLECTION_V1

V1_FILE = "grpc/reflection/v1/reflection.proto"  # the file's name in grpc/grpc and grpc-go
V1_PACKAGE = REFLECTION_V1.rpartition(".")[0]
V1ALPHA_PACKAGE = reflection.SERVICE_NAME.rpartition(".")[0]


def v1_file() -> descriptor.FileDescriptor:
    """grpc/reflection/v1/reflection.proto in the default pool, where the reflection servicer looks symbols up.

    grpcio-reflection ships the v1alpha proto only. v1 is that proto under another package: the same messages, fields,
    numbers and service, so its descriptor is v1alpha's renamed (its file options, which name v1alpha's Go and Java
    packages and mark it deprecated, left out)."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.ClearField("options")
    renamed = f".{V1ALPHA_PACKAGE}.", f".{V1_PACKAGE}."
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # message fields only; setting it on a scalar field would make it invalid
                field.type_name = field.type_name.replace(*renamed)
    for service in proto.service:
        for method in service.method:
            method.input_type, method.output_type = method.input_type.replace(*renamed), method.output_type.replace(*renamed)
    pool.AddSerializedFile(proto.SerializeToString())
    return pool.FindFileByName(V1_FILE)


def add_reflection(server: grpc.aio.Server, services: Sequence[str]) -> None:
    """Serves reflection for `services` and for itself, as grpc.reflection.v1alpha and grpc.reflection.v1: one servicer
    answers both, its v1alpha messages being v1's on the wire."""
    v1_file()
    servicer = reflection.aio.ReflectionServicer([*services, reflection.SERVICE_NAME, REFLECTION_V1])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                                               response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)  # fmt: skip
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1})])
