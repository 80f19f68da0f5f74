"""Bounds on every field of every request, checked before a handler sees it.

One walk over the message by its descriptor, so a field added to the protocol is bounded the
day it is added: strings and bytes have a length limit (4 KiB unless named below), repeated
fields and maps a count limit, doubles must be finite, enums one of their named values, and
integer counts, sizes and indexes of the cluster API are never negative. What a value means
(a batch size fits the data, a host is a host) is checked later, by the spec parser and the
handlers; this walk makes sure nothing unbounded or undefined reaches them.

A refusal is a ``SpecError`` naming the field (``model.keras_json``, ``tasks[3].message``),
so it reaches the caller as INVALID_ARGUMENT with the field in the ``strata-field`` trailer,
and it never quotes the value.

Pure logic: no gRPC here (``coordinator.rpcguard`` calls it).
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from strata.errors import SpecError

__all__ = ["MAX_STRING", "MAX_REPEATED", "check_request", "Undecodable"]

#: the limit of a string or bytes field not named in LONG_FIELDS
MAX_STRING = 4096
#: the limit of a repeated field or map not named in REPEATED_LIMITS
MAX_REPEATED = 10_000
#: nesting of messages within one request (the protocol itself nests at most 6 deep)
MAX_DEPTH = 16

_MiB = 1024 * 1024
#: fields that carry documents or data, by full name: their limit in characters or bytes
LONG_FIELDS: dict[str, int] = {
    "strata.v1.ModelSpec.keras_json": 16 * _MiB,    # the whole request is bounded by this too
    "strata.v1.KerasFile.config": 16 * _MiB,        # replaced by the stored file's own config
    "strata.v1.FileChunk.data": 4 * _MiB,           # chunks are 1 MiB
    "strata.v1.AppendLogsRequest.data": 4 * _MiB,   # agents send at most 256 KiB at a time
    "strata.v1.TaskStatus.message": 64 * 1024,      # a failure's message and traceback tail
}
REPEATED_LIMITS: dict[str, int] = {
    "strata.v1.BuiltinModel.input_shape": 8,
    "strata.v1.BuiltinModel.hidden": 1000,
    "strata.v1.FeatureSpec.shape": 8,
    "strata.v1.DataSpec.image_size": 2,
    "strata.v1.DataSpec.features": 1000,
    "strata.v1.OutOfMemory.shape": 64,
    "strata.v1.RegisterAgentRequest.free_ports": 64,
    "strata.v1.HeartbeatRequest.free_ports": 64,
}
#: integer fields of the cluster API that may be negative (an exit status is -signal)
SIGNED_INTS = frozenset({"strata.v1.TaskStatus.exit_code"})
#: messages whose integers are counts, sizes, steps or indexes: never negative. The job spec's
#: integers are checked by the spec parser, which names the range it wants.
_NON_NEGATIVE_SCOPE = ("strata.v1.TaskStatus", "strata.v1.OutOfMemory", "strata.v1.MemoryStatus",
                       "strata.v1.RegisterAgentRequest", "strata.v1.FileChunk",
                       "strata.v1.WatchJobRequest", "strata.v1.GetLogsRequest",
                       "strata.v1.AppendLogsRequest", "strata.v1.ListJobsRequest",
                       "strata.v1.ListWorkersRequest")


class Undecodable:
    """What the server's deserializer hands a handler in place of bytes that are not the
    request message: the handler refuses it with INVALID_ARGUMENT (gRPC itself would answer
    INTERNAL, or UNKNOWN, naming nothing)."""

    __slots__ = ("size", "message")

    def __init__(self, size: int, message: str):
        self.size = size
        self.message = message

    @staticmethod
    def deserializer(cls: type[Message]) -> Any:
        def parse(data: bytes) -> Message | Undecodable:
            try:
                return cls.FromString(data)
            except Exception:  # noqa: BLE001 - DecodeError, RuntimeError of upb, ...
                return Undecodable(len(data), cls.__name__)
        return parse


def _spec_path(path: str) -> str:
    """Paths inside a request's ``spec`` are named as the job file names them."""
    return path[len("spec."):] if path.startswith("spec.") else path


def check_request(msg: Message) -> None:
    """Raises ``SpecError`` for the first field of ``msg`` out of its bounds."""
    _walk(msg, "", 0)


def _walk(msg: Message, prefix: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise SpecError(_spec_path(prefix.rstrip(".")) or "request", "nested too deeply")
    desc = msg.DESCRIPTOR
    for field, value in msg.ListFields():
        path = prefix + field.name
        full = field.full_name
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            limit = REPEATED_LIMITS.get(full, MAX_REPEATED)
            if len(value) > limit:
                raise SpecError(_spec_path(path), f"at most {limit} entries, got {len(value)}")
            value_field = field.message_type.fields_by_name["value"]
            for key in value:
                _check_scalar(field.message_type.fields_by_name["key"], key, f"{path}.<key>",
                              desc.full_name)
                item = value[key]
                label = f"{path}[{str(key)[:32]!r}]"
                if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                    _walk(item, label + ".", depth + 1)
                else:
                    _check_scalar(value_field, item, label, desc.full_name)
            continue
        if field.is_repeated:
            limit = REPEATED_LIMITS.get(full, MAX_REPEATED)
            if len(value) > limit:
                raise SpecError(_spec_path(path), f"at most {limit} values, got {len(value)}")
            for i, item in enumerate(value):
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    _walk(item, f"{path}[{i}].", depth + 1)
                else:
                    _check_scalar(field, item, f"{path}[{i}]", desc.full_name)
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            _walk(value, path + ".", depth + 1)
        else:
            _check_scalar(field, value, path, desc.full_name)


_INTS = frozenset({FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64,
                   FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64,
                   FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_SFIXED64})


def _check_scalar(field: FieldDescriptor, value: Any, path: str, owner: str) -> None:
    t = field.type
    if t in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
        limit = LONG_FIELDS.get(field.full_name, MAX_STRING)
        if len(value) > limit:
            what = "characters" if t == FieldDescriptor.TYPE_STRING else "bytes"
            raise SpecError(_spec_path(path), f"at most {limit} {what}, got {len(value)}")
        if t == FieldDescriptor.TYPE_STRING and "\0" in value:
            raise SpecError(_spec_path(path), "contains a NUL character")
    elif t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        if not math.isfinite(value):
            raise SpecError(_spec_path(path), f"must be a finite number, got {value}")
    elif t == FieldDescriptor.TYPE_ENUM:
        if field.enum_type.values_by_number.get(value) is None:
            raise SpecError(_spec_path(path), f"{value} is not a {field.enum_type.name}")
    elif t in _INTS:
        if (value < 0 and owner.startswith(_NON_NEGATIVE_SCOPE)
                and field.full_name not in SIGNED_INTS):
            raise SpecError(_spec_path(path), f"must not be negative, got {value}")
