"""The wire format: one message (a *frame*) per push, reply or control message: a fixed int64 header,
then one flat byte payload, in a single uint8 buffer. Nothing is ever unpickled.

* :mod:`~pyasync.engine.wire.header`: the header fields, encoding, parsing, checksum;
* :mod:`~pyasync.engine.wire.layout`: the push and reply payload layouts, and views of them;
* :mod:`~pyasync.engine.wire.spec`: :class:`WireSpec`, what this rank accepts.

A receiver posts one receive into a buffer of :meth:`WireSpec.max_push_frame` /
:meth:`WireSpec.max_reply_frame` bytes, the largest frame its own layout allows (gloo accepts a message
up to the posted size), so no size a peer announces ever sizes an allocation. Receivers check every
field against what they expect before looking at the payload, and raise :class:`WireError` naming the
sender and the field. See Note [One message per push] in docs/architecture.md.
"""

from pyasync.engine.wire.header import (
    CLOSE,
    CONTROL_KINDS,
    FLAG_FINAL,
    FLAG_FINITE,
    FORMAT_VERSION,
    HEADER_BYTES,
    HEADER_LEN,
    KIND_NAMES,
    MAGIC,
    MAX_CLOCK,
    PAUSE,
    PUSH,
    REPLY,
    RESUME,
    Header,
    encode_header,
    frame_body,
    frame_header,
    parse_header,
    put_ints,
    seal,
)
from pyasync.engine.wire.layout import (
    coded_reply_parts,
    coded_reply_views,
    pack_push,
    pack_reply,
    push_parts,
    push_views,
    reply_parts,
    reply_views,
    unpack_coded_reply,
    unpack_push,
    unpack_reply,
)
from pyasync.engine.wire.spec import WireSpec
from pyasync.errors import WireError
from pyasync.ops._common import CODEC_IDS

__all__ = [
    "CLOSE",
    "CODEC_IDS",
    "CONTROL_KINDS",
    "FLAG_FINAL",
    "FLAG_FINITE",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "HEADER_LEN",
    "KIND_NAMES",
    "MAGIC",
    "MAX_CLOCK",
    "PAUSE",
    "PUSH",
    "REPLY",
    "RESUME",
    "Header",
    "WireError",
    "WireSpec",
    "coded_reply_parts",
    "coded_reply_views",
    "encode_header",
    "frame_body",
    "frame_header",
    "pack_push",
    "pack_reply",
    "parse_header",
    "push_parts",
    "push_views",
    "put_ints",
    "reply_parts",
    "reply_views",
    "seal",
    "unpack_coded_reply",
    "unpack_push",
    "unpack_reply",
]
