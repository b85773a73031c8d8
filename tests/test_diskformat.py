"""The entry format's parse and verify: the reader's shortcuts give exactly what the plain calls give."""

from __future__ import annotations

import uuid
from typing import Optional

from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_kv.disk.format import (HEADER_SIZE, CorruptEntry, EntryHeader, pack_header, pack_slot_entry,
                                  parse_header, verify_entry)

NS = b"ns|test"


def test_parsed_token_is_a_plain_uuid_equal_to_the_writers():
    tok = uuid.uuid4()
    h = parse_header(pack_slot_entry(NS, b"k", tok, b"x" * 64, 3, 9))
    assert type(h.token) is uuid.UUID
    assert h.token == tok and hash(h.token) == hash(tok) and str(h.token) == str(tok)
    assert h.token.bytes == tok.bytes and h.token.version == 4 and h.token.is_safe is tok.is_safe
    assert {h.token: 1}[tok] == 1
    assert h == EntryHeader(NS, b"k", tok, 64, 3, -1, 9) and h.in_slot and h.slot == 9


def test_inline_header_fields():
    tok = uuid.uuid4()
    value = pack_header(NS, b"key", tok, b"p" * 10, 5) + b"p" * 10
    h = parse_header(value)
    assert not h.in_slot and h.slot == -1 and h.payload_offset == HEADER_SIZE + len(NS) + 3
    assert value[h.payload_offset:] == b"p" * 10


def _outcome(value: bytes, payload: Optional[bytes], header: Optional[EntryHeader]) -> object:
    try:
        return verify_entry(value, NS, b"key", 64, payload, header)
    except CorruptEntry as exc:
        return ("corrupt", exc.reason, str(exc))


@settings(max_examples=300, deadline=None)
@given(in_slot=st.booleans(), where=st.integers(0, 1 << 16), bit=st.integers(0, 7),
       damage_payload=st.booleans(), cut=st.integers(0, 64))
def test_verify_with_the_lookups_header_answers_what_a_fresh_parse_answers(in_slot, where, bit, damage_payload,
                                                                           cut):
    """The reader hands verify_entry the header its lookup parsed: same verdict and header, any damage."""
    tok = uuid.uuid4()
    payload = bytes(range(64))
    if in_slot:
        value = bytearray(pack_slot_entry(NS, b"key", tok, payload, 1, 4))
        read: Optional[bytes] = bytearray(payload)
    else:
        value = bytearray(pack_header(NS, b"key", tok, payload, 1) + payload)
        read = None
    if damage_payload and read is not None:
        read[where % len(read)] ^= 1 << bit
        read = bytes(read[:len(read) - cut])
    else:
        value[where % len(value)] ^= 1 << bit
    value_b = bytes(value)
    try:
        h: Optional[EntryHeader] = parse_header(value_b)
    except CorruptEntry:
        h = None   # the reader never gets as far as verify: its lookup answers corrupt
    if h is not None:
        assert _outcome(value_b, read, h) == _outcome(value_b, read, None)
