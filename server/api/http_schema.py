"""The OpenAPI document of the HTTP API, generated from the proto's message descriptors (one source of truth for schemas).

Bodies are the proto messages in the proto3 JSON mapping (google.protobuf.json_format) with the proto's field names;
the parser accepts their lowerCamelCase names too.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.api.http_status import HTTP_STATUS, OTHER_STATUS, PAYLOAD_TOO_LARGE, REQUEST_TIMEOUT, RETRY_AFTER_S, UNSUPPORTED_MEDIA_TYPE

# proto3 JSON: 64-bit integers travel as strings, the others as JSON numbers.
SCALARS = {
    FieldDescriptor.TYPE_DOUBLE: {"type": "number"}, FieldDescriptor.TYPE_FLOAT: {"type": "number"},
    FieldDescriptor.TYPE_INT32: {"type": "integer", "format": "int32"}, FieldDescriptor.TYPE_SINT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "format": "int32", "minimum": 0},
    FieldDescriptor.TYPE_INT64: {"type": "string", "format": "int64"}, FieldDescriptor.TYPE_UINT64: {"type": "string", "format": "int64"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"}, FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "format": "byte"},
}  # fmt: skip
ERROR = "Error"
TIMEOUT_HEADER = "Request-Timeout"  # seconds; the HTTP counterpart of a gRPC deadline (none: the server's default)
# path -> (method, summary, request message or None, response message, SSE?)
ENDPOINTS: dict[str, tuple[str, str, Descriptor | None, Descriptor, bool]] = {
    "/v1/translate": ("post", "Translate a batch of German texts (the Translate RPC)", pb.TranslateRequest.DESCRIPTOR,
                      pb.TranslateResponse.DESCRIPTOR, False),
    "/v1/translate/stream": ("post", "Translate one text as server-sent events, one TranslateStreamResponse per event "
                             "(the TranslateStream RPC); a failure after the first event is an `error` event", pb.TranslateStreamRequest.DESCRIPTOR,
                             pb.TranslateStreamResponse.DESCRIPTOR, True),
    "/v1/models": ("get", "Every served model (the ListModels RPC)", None, pb.ListModelsResponse.DESCRIPTOR, False),
    "/v1/models/{name}": ("get", "One served model (the GetModelInfo RPC)", None, pb.ModelInfo.DESCRIPTOR, False),
}  # fmt: skip
PROBES = {"/healthz": "Live: 200 while the process answers", "/readyz": "Ready: 200 once warm and not draining, else 503"}


def message_schemas(root: Descriptor, schemas: dict[str, Any]) -> None:
    """`root` and every message and enum it reaches, as components/schemas entries named by their proto names."""
    if root.name in schemas:
        return
    properties: dict[str, Any] = {}
    schemas[root.name] = {"type": "object", "properties": properties, "additionalProperties": False}
    for field in root.fields:
        if field.message_type is not None:
            message_schemas(field.message_type, schemas)
            item: dict[str, Any] = {"$ref": f"#/components/schemas/{field.message_type.name}"}
        elif field.enum_type is not None:
            enum_schema(field.enum_type, schemas)
            item = {"$ref": f"#/components/schemas/{field.enum_type.name}"}
        else:
            item = dict(SCALARS[field.type])
        properties[field.name] = {"type": "array", "items": item} if field.is_repeated else item


def enum_schema(enum: EnumDescriptor, schemas: dict[str, Any]) -> None:
    schemas[enum.name] = {"type": "string", "enum": [value.name for value in enum.values]}


def error_schema() -> dict[str, Any]:
    return {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["code", "message"],
        "properties": {"code": {"type": "string", "description": f"the gRPC status code's name, or {PAYLOAD_TOO_LARGE}, {REQUEST_TIMEOUT} or {UNSUPPORTED_MEDIA_TYPE}",
                                "example": "INVALID_ARGUMENT"},
                       "message": {"type": "string", "description": "what was wrong, naming the field and its limit"},
                       "details": {"type": "array", "description": "google.rpc details in proto3 JSON: a google.rpc.BadRequest with "
                                   "fieldViolations for INVALID_ARGUMENT, a google.rpc.RetryInfo with retryDelay for a status worth "
                                   "retrying", "items": {"type": "object", "required": ["@type"],
                                                         "properties": {"@type": {"type": "string"}}, "additionalProperties": True}}}}}}  # fmt: skip


def error_responses() -> dict[str, Any]:
    """One response per HTTP status of the table, its codes named."""
    by_status: dict[int, list[str]] = {}
    for code, status in HTTP_STATUS.items():
        if status != 200:
            by_status.setdefault(status, []).append(code)
    by_status.setdefault(OTHER_STATUS, []).append("any other code")
    responses = {}
    for status, codes in sorted(by_status.items()):
        response: dict[str, Any] = {"description": " or ".join(codes),
                                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ERROR}"}}}}
        if status in RETRY_AFTER_S:
            response["headers"] = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
        responses[str(status)] = response
    return responses


def operation(summary: str, request: Descriptor | None, response: Descriptor, sse: bool, path: str) -> dict[str, Any]:
    media = "text/event-stream" if sse else "application/json"
    ok = {"description": "OK", "content": {media: {"schema": {"$ref": f"#/components/schemas/{response.name}"}}}}
    result: dict[str, Any] = {"summary": summary, "operationId": path.strip("/").replace("/", "_").replace("{", "").replace("}", ""),
                              "security": [{"bearer": []}], "responses": {"200": ok, **error_responses()}}
    if request is not None:
        result["requestBody"] = {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request.name}"}}}}
    result["parameters"] = [{"name": TIMEOUT_HEADER, "in": "header", "required": False, "schema": {"type": "number", "exclusiveMinimum": 0},
                             "description": "the call's deadline in seconds, from its arrival (a gRPC deadline's twin); without it the "
                                            "server's --default-deadline-s, and never more than its --max-deadline-s"}]  # fmt: skip
    if "{name}" in path:
        result["parameters"].append({"name": "name", "in": "path", "required": True, "schema": {"type": "string"},
                                     "description": "a served model's name (GET /v1/models)"})  # fmt: skip
    return result


def openapi_document(version: str) -> dict[str, Any]:
    schemas: dict[str, Any] = {ERROR: error_schema()}
    paths: dict[str, Any] = {}
    for path, (method, summary, request, response, sse) in ENDPOINTS.items():
        for message in (request, response):
            if message is not None:
                message_schemas(message, schemas)
        paths[path] = {method: operation(summary, request, response, sse, path)}
    for path, summary in PROBES.items():
        paths[path] = {"get": {"summary": summary, "operationId": path.strip("/"), "security": [],
                               "responses": {"200": {"description": "OK"}, "503": {"description": "not ready"}}}}  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": "nmt-serve HTTP API", "version": version,
                 "description": "German->English translation; the same service as the gRPC API nmt.translation.v1.TranslationService."},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }  # fmt: skip
