"""Server-side names of the remote tier, and the Lua scripts that make its writes conditional.

Every name of one block shares one hash tag, so a block's value and tombstones live in one cluster
slot and one script may touch them all::

    tkv:{<ns>:<kid>}:v               the value: the disk format's inline entry (header + payload)
    tkv:{<ns>:<kid>}:t               key tombstone: refuses every write of the key (invalidate)
    tkv:{<ns>:<kid>}:x:<token hex>   token tombstone: refuses the writes of one job (cancel)
    tkv:{<ns>:<kid>}:s:<token hex>   a put's staged value (SET with a short TTL, renamed by the publish script)

``<ns>`` is the xxh3_64 hex of the namespace and ``<kid>`` the xxh3_128 hex of the block key.  The
full namespace and key are inside the value's header and verified on every read, so a digest
collision, a foreign namespace or a value written by anything else is a miss, never wrong bytes.

A put is two commands in one pipeline: a plain ``SET`` of the staged value, then the publish script,
which renames it into place unless a tombstone refuses it (and deletes it then).  The payload never
passes through Lua: a script argument is copied into a Lua string and again by ``SET``, which costs the
(shared, single-threaded) server about twice the CPU of a plain ``SET`` at 256 KiB, while ``RENAME``
is O(1) (benchmarks/remote_raw.py).  A staged value whose script never ran expires after ``STAGE_TTL_S``.
"""

from __future__ import annotations

import hashlib
import uuid

import xxhash

from ..disk.format import HEADER_STRUCT, Buffer

__all__ = ["KeyNames", "TOKEN_OFFSET", "STAGE_TTL_S", "NOT_STAGED", "KEY_TOMB_CHECK", "TOKEN_TOMB_CHECK",
           "PUBLISH", "CANCEL", "INVALIDATE", "DROP_IF_SAME", "SCRIPTS",
           "PUBLISHED", "REFUSED_TOMB", "REFUSED_TOKEN", "REFUSED_LATE", "LATE_CHECK", "sha1hex"]

# offset of the writer token in an entry: magic 4s, version H, flags H, ns_len H, key_len H, length Q, seq Q
TOKEN_OFFSET = HEADER_STRUCT.size - 16
assert TOKEN_OFFSET == 28

PUBLISHED, REFUSED_TOMB, REFUSED_TOKEN, NOT_STAGED, REFUSED_LATE = 0, 1, 2, 3, 4   # PUBLISH's answers
STAGE_TTL_S = 60          # a staged value outlives its script by this long at most

# KEYS: staged value, value, key tomb, token tomb; ARGV: ttl seconds (0: none), the put's deadline (unix ms,
# the writer's clock; 0: none).  NOT_STAGED: the SET before it failed (its own error says why) or the staged
# value was evicted (maxmemory with an allkeys policy).  REFUSED_LATE: the script runs past the deadline --
# bytes the network delivered long after the writer gave the put up (a client timeout bounds only the
# client's wait): a tombstone of an invalidation made since may have expired already, so it must not
# publish.  The writer sets the deadline half a tombstone's lifetime after it queued the write (clocks may
# differ by as much).
# the refusals, named so that tests can take one out of the script and see a model catch it
LATE_CHECK = ("if tonumber(ARGV[2]) > 0 then local t = redis.call('TIME'); "
              "if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > tonumber(ARGV[2]) then "
              "redis.call('DEL', KEYS[1]); return 4 end end")
KEY_TOMB_CHECK = "if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('DEL', KEYS[1]); return 1 end"
TOKEN_TOMB_CHECK = "if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('DEL', KEYS[1]); return 2 end"
PUBLISH = LATE_CHECK + "\n" + KEY_TOMB_CHECK + "\n" + TOKEN_TOMB_CHECK + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 3 end
redis.call('RENAME', KEYS[1], KEYS[2])
local ttl = tonumber(ARGV[1])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[2], ttl)
else
  redis.call('PERSIST', KEYS[2])
end
return 0
"""

# KEYS: value, token tomb; ARGV: token (16 bytes), tomb ttl seconds.  The token-matched delete goes first:
# under maxmemory (noeviction) the tomb's SET fails and aborts the script, the DEL still counts.  A value of
# another type under the name (not ours: GETRANGE would abort the script before the tomb) is left alone.
CANCEL = f"""
local gone = 0
if redis.call('TYPE', KEYS[1]).ok == 'string' and
   redis.call('GETRANGE', KEYS[1], {TOKEN_OFFSET}, {TOKEN_OFFSET + 15}) == ARGV[1] then
  gone = redis.call('DEL', KEYS[1])
end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[2])
return gone
"""

# KEYS: value, key tomb; ARGV: tomb ttl seconds.  DEL first for the same reason as CANCEL.
INVALIDATE = """
local gone = redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[2], '1', 'EX', ARGV[1])
return gone
"""

# KEYS: value; ARGV: sha1 hex of the bad value a reader saw.  Never deletes a value written since.
DROP_IF_SAME = """
if ARGV[1] == '' then
  local t = redis.call('TYPE', KEYS[1])
  if t.ok ~= 'string' and t.ok ~= 'none' then return redis.call('DEL', KEYS[1]) end
  return 0
end
local v = redis.call('GET', KEYS[1])
if v and redis.sha1hex(v) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

SCRIPTS = {"publish": PUBLISH, "cancel": CANCEL, "invalidate": INVALIDATE, "drop_if_same": DROP_IF_SAME}


def sha1hex(*parts: Buffer) -> str:
    """What Lua's ``redis.sha1hex`` returns for the concatenation of ``parts`` (and what EVALSHA names a
    script by)."""
    h = hashlib.sha1()
    for p in parts:
        h.update(p)
    return h.hexdigest()


class KeyNames:
    """The server names of one namespace's blocks (built once per store; the methods are pure)."""

    __slots__ = ("namespace", "ns_bytes", "ns_id", "_prefix")

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.ns_bytes = namespace.encode()
        self.ns_id = xxhash.xxh3_64_hexdigest(self.ns_bytes)
        self._prefix = "tkv:{" + self.ns_id + ":"

    def tag(self, key: bytes) -> str:
        """``tkv:{<ns>:<kid>}``: the part every name of ``key`` starts with."""
        return self._prefix + xxhash.xxh3_128_hexdigest(key) + "}"

    def value(self, key: bytes) -> str:
        return self.tag(key) + ":v"

    def tomb(self, key: bytes) -> str:
        return self.tag(key) + ":t"

    def token_tomb(self, key: bytes, token: uuid.UUID) -> str:
        return self.tag(key) + ":x:" + token.hex

    def staged(self, key: bytes, token: uuid.UUID) -> str:
        return self.tag(key) + ":s:" + token.hex
