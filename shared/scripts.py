"""The Lua scripts that make buffer operations atomic (the hand-backs: scripts_stranded.py).

Redis runs a script alone, but does not roll back one that fails half-way,
so each script checks everything before its first write. Above all, what
settles a claimed entry first checks that the entry is still pending for
*this* consumer: a slow producer whose prompt was reclaimed (and perhaps
completed) by another one meanwhile writes nothing.

Settling a claim with a group payload is not one script but WATCH, a gate
script, MULTI ... EXEC, sent as one round trip (see shared/streams.py):
Redis's Lua hashes every byte of every string argument it receives, so a
130 KiB group passed through a script cost Redis ~330 µs of CPU against
~120 µs for a plain XADD (bench/buffer.py, 2-core machine).
"""

from __future__ import annotations

import redis
from redis.commands.core import Script

from rollstream.shared.codec import FORMAT_VERSION

# Fields a dead letter sets itself, in this order: why, how many deliveries, the stream and
# id it came from (an original field of the same name is kept as "orig.NAME").
DEAD_HEADER = ("reason", "attempts", "source", "source_id")


def _lua_strings(names: tuple[str, ...]) -> str:
    """A Lua table of the names, to format a script's names in when it is loaded."""
    return "{" + ", ".join(f"'{name}'" for name in names) + "}"


DEAD_LETTER_FN = (
    """
local DEAD_HEADER = """
    + _lua_strings(DEAD_HEADER)
    + """
local function dead_letter(dead, source, id, reason, attempts, fields, cap)
  local args, header, values = {}, {}, {reason, attempts, source, id}
  for i, name in ipairs(DEAD_HEADER) do
    args[#args + 1] = name
    args[#args + 1] = values[i]
    header[name] = true
  end
  if fields then
    for i = 1, #fields, 2 do
      local name = fields[i]
      if header[name] then name = 'orig.' .. name end
      args[#args + 1] = name
      args[#args + 1] = fields[i + 1]
    end
  end
  -- capped (MAXLEN ~) when the caller gave a cap: readers must not rely on older dead letters
  if cap and cap ~= '' then return redis.call('XADD', dead, 'MAXLEN', '~', cap, '*', unpack(args)) end
  return redis.call('XADD', dead, '*', unpack(args))
end
"""
)

# A counter that HINCRBY increments: an integer as Redis writes one. tonumber() also takes
# '1.5', '0x10' or ' 7', which HINCRBY refuses after the script's earlier writes.
CHECK_COUNTER_FN = """
local function check_counter(hash, field)
  if field == '' then return end
  local v = redis.call('HGET', hash, field)
  if v and not (#v <= 20 and string.match(v, '^%-?%d+$')) then
    error('progress field ' .. field .. ' is not a number: ' .. v)
  end
end
"""

PRIOR_ATTEMPTS = "attempts"  # a claim handed back keeps its deliveries (scripts_stranded.py)
PRIOR_ATTEMPTS_FN = """
local function prior_attempts(f)
  for j = 1, #f, 2 do if f[j] == 'attempts' then return tonumber(f[j + 1]) or 0 end end return 0 end
"""

# KEYS: source stream, progress hash, fence counter of the source, destination streams...
# ARGV: group, consumer, number of entries k, k entry ids, number of progress fields n that
#       HINCRBY increments, those n fields, then the fields HINCRBYFLOAT increments
# The gate of a settle of k entries of one stream (see streams.py), run between WATCH
# fence and MULTI: returns 1 when every entry is still pending for this consumer and
# the queued writes cannot fail. Otherwise it bumps the fence, which this very client
# WATCHes, so that the EXEC that follows writes nothing, and returns the (1-based)
# positions of the entries that are no longer this consumer's, or the error.
SETTLE_GATE = """
local function refuse(reply)
  local bumped = redis.pcall('INCR', KEYS[3])
  if type(bumped) == 'table' then redis.call('DEL', KEYS[3]) end  -- not a counter: DEL it
  return reply
end
local k = tonumber(ARGV[3])
local lost = {}
for i = 1, k do
  local id = ARGV[3 + i]
  local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2])
  if pending.err then return refuse(pending) end
  if #pending == 0 then lost[#lost + 1] = i end
end
if #lost > 0 then return refuse(lost) end
-- each counter as its command will read it: HINCRBY an integer (not '1.5', '0x10', ' 7',
-- which tonumber() takes), HINCRBYFLOAT a finite number; else EXEC would fail it after
-- the appends, acks and deletes before it had run
local integers = 5 + k + tonumber(ARGV[4 + k])
for i = 5 + k, #ARGV do
  local count = redis.pcall('HGET', KEYS[2], ARGV[i])
  if type(count) == 'table' and count.err then return refuse(count) end
  if count then
    local ok
    if i < integers then
      ok = #count <= 20 and string.match(count, '^%-?%d+$')
    else
      local n = tonumber(count)
      ok = n and n == n and n ~= math.huge and n ~= -math.huge and not string.find(count, '%s')
    end
    if not ok then
      return refuse(redis.error_reply('progress field ' .. ARGV[i] .. ' is not a number: ' .. count))
    end
  end
end
for i = 4, #KEYS do
  local t = redis.call('TYPE', KEYS[i]).ok
  if t ~= 'stream' and t ~= 'none' then
    return refuse(redis.error_reply(KEYS[i] .. ' holds a ' .. t .. ', not a stream'))
  end
end
return 1
"""


def _commit_script(
    first_id: int, *, prelude: str = "", log: str = "", delete: str = "", trim: str = "", reply: str
) -> str:
    """A commit script, from the body COMMIT and COMMIT_LOGGED share: the ids from ARGV
    ``first_id`` on split into those still pending for this consumer (owned) and the
    others (foreign); the progress field checked before any write; the owned acked and
    counted. The Lua pieces: ``prelude`` after the checks and before any write; ``log``
    before the XACK, ``delete`` after it and ``trim`` after the count, those three only
    when some ids are owned; then ``reply`` is returned."""
    return (
        CHECK_COUNTER_FN
        + f"""
local owned, foreign = {{}}, {{}}
for i = {first_id}, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p == 0 then foreign[#foreign + 1] = ARGV[i] else owned[#owned + 1] = ARGV[i] end
end
check_counter(KEYS[2], ARGV[3])
{prelude}if #owned > 0 then
{log}  redis.call('XACK', KEYS[1], ARGV[1], unpack(owned))
{delete}  if ARGV[3] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[3], #owned) end
{trim}end
return {reply}
"""
    )


# KEYS: stream, progress hash
# ARGV: group, consumer, progress field ('' = none), ids...
# Acks and deletes the ids still pending for this consumer; returns the ids it did not own.
COMMIT = _commit_script(
    4,
    delete="""\
  redis.call('XDEL', KEYS[1], unpack(owned))
""",
    reply="foreign",
)

# The fields of a trained-log entry (rs:{run}:trained:{task}): the id of the group in the
# task's groups stream, the train step that trained it, when, and by which consumer.
TRAINED_FIELDS = ("source_id", "train_step", "trained_at", "trained_by")

# KEYS: stream, progress hash, trained log of the stream's task
# ARGV: group, consumer, progress field ('' = none), train step, time, log cap, ids...
# COMMIT with an archive (archive.keep > 0): the owned ids are acked and counted, and each
# gets a small entry in the trained log, but is not deleted: the archiver reads the group
# from the stream, writes it, and deletes both (ARCHIVE_ACK). The log holds at most `cap`
# entries: past it, the oldest entries go, with their groups (never archived: counted in
# the reply). Copying the payload into the log instead costs ~7x a plain commit (the
# entry's values become Lua strings, bench/archive.py); this costs nothing more.
# Returns {foreign ids, the log's length, groups trimmed unarchived}.
COMMIT_LOGGED = _commit_script(
    7,
    prelude="""\
local t = redis.call('TYPE', KEYS[3]).ok
if t ~= 'stream' and t ~= 'none' then error(KEYS[3] .. ' holds a ' .. t .. ', not a stream') end
local trimmed = 0
""",
    log="""\
  for _, id in ipairs(owned) do
    redis.call('XADD', KEYS[3], '*', 'source_id', id, 'train_step', ARGV[4], 'trained_at', ARGV[5],
               'trained_by', ARGV[2])
  end
""",
    trim="""\
  local over = redis.call('XLEN', KEYS[3]) - tonumber(ARGV[6])
  if over > 0 then
    for _, old in ipairs(redis.call('XRANGE', KEYS[3], '-', '+', 'COUNT', over)) do
      local f = old[2]
      for j = 1, #f, 2 do
        if f[j] == 'source_id' then redis.call('XDEL', KEYS[1], f[j + 1]) end
      end
      redis.call('XDEL', KEYS[3], old[1])
      trimmed = trimmed + 1
    end
  end
""",
    reply="{foreign, redis.call('XLEN', KEYS[3]), trimmed}",
)

# KEYS: a trained log, its task's groups stream
# ARGV: the archiver's group, k, k log ids, the k groups' ids in the stream
# The archiver's ack once its files are in place: XACK and XDEL the log entries, and XDEL
# each group that no consumer group of the stream still needs (delivered to every group,
# pending in none: a reader of its own beside the trainer loses nothing). Returns the
# number of groups deleted.
ARCHIVE_ACK = """
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function after(a, b)  -- stream ids: a > b
  local am, as = parse(a)
  local bm, bs = parse(b)
  return am > bm or (am == bm and as > bs)
end
local k = tonumber(ARGV[2])
if k == 0 then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 3, 2 + k))
redis.call('XDEL', KEYS[1], unpack(ARGV, 3, 2 + k))
local groups = {}
if redis.call('EXISTS', KEYS[2]) == 1 then groups = redis.call('XINFO', 'GROUPS', KEYS[2]) end
local gone = {}
for i = 3 + k, 2 + 2 * k do
  local id, needed = ARGV[i], false
  for _, g in ipairs(groups) do
    local name, last
    for j = 1, #g, 2 do
      if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'last-delivered-id' then last = g[j + 1] end
    end
    if after(id, last) or #redis.call('XPENDING', KEYS[2], name, id, id, 1) > 0 then
      needed = true
      break
    end
  end
  if not needed then gone[#gone + 1] = id end
end
if #gone > 0 then redis.call('XDEL', KEYS[2], unpack(gone)) end
return #gone
"""

# KEYS: stream, dead stream, progress hash, fence counter of the stream
# ARGV: group, consumer, min idle ms, start id, count, max attempts, dead progress field,
#       groups_dead progress field ('' = none), '1' to take back own entries too, then
#       'maxlen=N', the dead stream's cap (MAXLEN ~, buffer.dead_maxlen; optional), then the
#       ids of this stream the caller holds (never taken)
# Takes over entries idle longer than min idle from *other* consumers, and the caller's
# own entries that it no longer holds (a settle that failed on a lost connection, a claim
# or a read whose reply was lost and the command sent again: pending under a live
# consumer that does not know it has them), and bumps the fence counter when it does,
# which aborts any settle in flight (WATCH); those delivered more than max attempts
# times, and those deleted while pending, become dead letters.
# Returns {next start id ('0-0' when done), {{id, fields, deliveries}...}}.
#
# Not XAUTOCLAIM: it cannot leave the caller's held entries alone (a live producer
# would take back, and count again, a claim it is still generating), and Redis 6.2
# answers an entry deleted while pending with a nil in place of the entry, id and all.
# XPENDING ... IDLE names each entry's owner; XCLAIM then takes one entry at a time.
RECLAIM = (
    DEAD_LETTER_FN
    + CHECK_COUNTER_FN
    + PRIOR_ATTEMPTS_FN
    + """
check_counter(KEYS[3], ARGV[7])
check_counter(KEYS[3], ARGV[8])
local count = tonumber(ARGV[5])
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[3], ARGV[4], '+', count)
local max_attempts = tonumber(ARGV[6])
local own, held = ARGV[9] == '1', {}
local cap, first = nil, 10
if ARGV[10] and string.sub(ARGV[10], 1, 7) == 'maxlen=' then cap, first = string.sub(ARGV[10], 8), 11 end
for i = first, #ARGV do held[ARGV[i]] = true end
local out, dead, fenced = {}, 0, false
for _, p in ipairs(pending) do
  local id, owner, deliveries = p[1], p[2], p[4] + 1
  if owner ~= ARGV[2] or (own and not held[id]) then
    if not fenced then
      redis.call('INCR', KEYS[4])
      fenced = true
    end
    local claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], id)
    local entry = claimed[1]
    if entry and entry[2] then deliveries = deliveries + prior_attempts(entry[2]) end
    if not entry or not entry[2] then
      -- deleted while pending: Redis 7 has dropped it from the pending list, 6.2 keeps it
      redis.call('XACK', KEYS[1], ARGV[1], id)
      dead_letter(KEYS[2], KEYS[1], id, 'deleted while pending', deliveries, nil, cap)
      dead = dead + 1
    elseif deliveries > max_attempts then
      local reason = 'delivered ' .. deliveries .. ' times, more than max_attempts ' .. max_attempts
      dead_letter(KEYS[2], KEYS[1], id, reason, deliveries, entry[2], cap)
      redis.call('XACK', KEYS[1], ARGV[1], id)
      redis.call('XDEL', KEYS[1], id)
      dead = dead + 1
    else
      out[#out + 1] = {id, entry[2], deliveries}
    end
  end
end
if dead > 0 and ARGV[7] ~= '' then redis.call('HINCRBY', KEYS[3], ARGV[7], dead) end
if dead > 0 and ARGV[8] ~= '' then redis.call('HINCRBY', KEYS[3], ARGV[8], dead) end
local cursor = '0-0'
if #pending == count then cursor = '(' .. pending[#pending][1] end
return {cursor, out}
"""
)

# KEYS: stream, dead stream, progress hash, fence counter of the stream
# ARGV: group, id, reason, dead progress field, groups_dead progress field ('' = none),
#       the dead stream's cap (MAXLEN ~, buffer.dead_maxlen; optional)
# An operator's dead letter of one entry, pending or not, whoever holds it: appends the
# dead letter, acks and deletes the entry, counts it, and bumps the fence (a settle of its
# holder in flight then finds it gone and writes nothing). Returns {dead letter id, owner
# ('' when not pending), deliveries}; {its dead letter's id, '', -1} when one of the newest
# 1000 dead letters is that entry already; else an error NOENTRY.
DEAD_LETTER_BY_HAND = (
    DEAD_LETTER_FN
    + CHECK_COUNTER_FN
    + """
local t = redis.call('TYPE', KEYS[1]).ok
if t ~= 'stream' then return redis.error_reply('NOENTRY ' .. KEYS[1] .. ' is not a stream') end
local entry = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])[1]
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if not entry and #pending == 0 then
  -- moved already (this very call sent again after a lost reply, or typed twice)?
  for _, dead in ipairs(redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1000)) do
    local f = dead[2]
    if f[6] == KEYS[1] and f[8] == ARGV[2] then return {dead[1], '', -1} end
  end
  return redis.error_reply('NOENTRY no entry ' .. ARGV[2] .. ' in ' .. KEYS[1])
end
check_counter(KEYS[3], ARGV[4])
check_counter(KEYS[3], ARGV[5])
local owner, deliveries = '', 0
if #pending > 0 then owner, deliveries = pending[1][2], pending[1][4] end
redis.call('INCR', KEYS[4])
local dead = dead_letter(KEYS[2], KEYS[1], ARGV[2], ARGV[3], deliveries, entry and entry[2] or nil, ARGV[6])
if #pending > 0 then redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) end
if entry then redis.call('XDEL', KEYS[1], ARGV[2]) end
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
if ARGV[5] ~= '' then redis.call('HINCRBY', KEYS[3], ARGV[5], 1) end
return {dead, owner, deliveries}
"""
)

# KEYS: stream
# ARGV: group, consumer, ids...
# Resets the idle time of the ids still pending for this consumer (a heartbeat of work
# in progress, so that nobody reclaims it); returns the ids that are no longer its own.
TOUCH = """
local lost, mine = {}, {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p == 0 then lost[#lost + 1] = ARGV[i] else mine[#mine + 1] = ARGV[i] end
end
if #mine > 0 then
  -- unpack() must come last in an argument list, or Lua keeps only its first value
  mine[#mine + 1] = 'JUSTID'
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, unpack(mine))
end
return lost
"""

# KEYS: aborted, expired, prompts streams of one task, progress hash
# ARGV: group, consumer, count, limit, '1' to include the expired pool, then progress
#       fields: the task's accepted count, then those subtracted from it
# Admission control, atomic across producers: claims new entries, in pool order, only
# while accepted + running < limit. accepted = completed minus the UNTRAINABLE counters
# (groups that can still be trained on); running = entries pending in the pools, the
# group's total from XINFO GROUPS: O(groups of the stream), where XPENDING's summary form
# also lists every consumer, O(consumers) and 3 x 64 of them a claim at 64 producers.
# Returns {{stream, id, {field, value, ...}}, ...}.
CLAIM_BOUNDED = """
local function counter(field)
  return tonumber(redis.call('HGET', KEYS[4], field) or '0') or 0
end
local accepted = counter(ARGV[6])
for i = 7, #ARGV do accepted = accepted - counter(ARGV[i]) end
local running = 0
local function pending(stream)
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if groups.err == nil then
    for _, group in ipairs(groups) do
      local name, count
      for j = 1, #group, 2 do
        if group[j] == 'name' then name = group[j + 1] end
        if group[j] == 'pending' then count = group[j + 1] end
      end
      if name == ARGV[1] then return tonumber(count) end
    end
  end
  -- no such stream or group: XPENDING answers with the error it always did
  return redis.call('XPENDING', stream, ARGV[1])[1]
end
for i = 1, 3 do running = running + pending(KEYS[i]) end
local room = math.min(tonumber(ARGV[3]), tonumber(ARGV[4]) - accepted - running)
local out = {}
for i = 1, 3 do
  if room <= 0 then break end
  if i ~= 2 or ARGV[5] == '1' then
    local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', room,
                             'STREAMS', KEYS[i], '>')
    -- nil when nothing is new; fakeredis answers {} then, and {stream, entries} unwrapped
    local entries = reply and reply[1] and (type(reply[1]) == 'table' and reply[1][2] or reply[2])
    if entries then
      for _, entry in ipairs(entries) do
        out[#out + 1] = {KEYS[i], entry[1], entry[2]}
        room = room - 1
      end
    end
  end
end
return out
"""

# KEYS: prompts stream, fed-uid set, progress hash
# ARGV: progress field, then (uid, task, data) triples. Idempotent by uid.
FEED = (
    CHECK_COUNTER_FN
    + """
if redis.call('TYPE', KEYS[1]).ok ~= 'stream' and redis.call('EXISTS', KEYS[1]) == 1 then
  error(KEYS[1] .. ' is not a stream')
end
check_counter(KEYS[3], ARGV[1])
local added = 0
for i = 2, #ARGV, 3 do
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then
    redis.call('XADD', KEYS[1], '*', 'uid', ARGV[i], 'task', ARGV[i + 1], 'data', ARGV[i + 2],
               'format', '"""
    + FORMAT_VERSION
    + """')
    added = added + 1
  end
end
if added > 0 then redis.call('HINCRBY', KEYS[3], ARGV[1], added) end
return added
"""
)

# KEYS: prompts stream, state hash, progress hash
# ARGV: cursor field, expected cursor ('' = none yet), new cursor, progress field,
#       write field, this call's token, then (uid, task, data) triples. Fails without
#       writing when the cursor moved, unless this very call moved it: sent again after
#       its reply was lost, it finds its token in the write field and answers as it did.
FEED_AT_CURSOR = (
    CHECK_COUNTER_FN
    + """
local current = redis.call('HGET', KEYS[2], ARGV[1]) or ''
if current ~= ARGV[2] then
  local last = redis.call('HGET', KEYS[2], ARGV[5]) or ''
  local mine = ARGV[6] .. ' '
  if current == ARGV[3] and string.sub(last, 1, #mine) == mine then
    return tonumber(string.sub(last, #mine + 1))
  end
  return redis.error_reply('CURSOR ' .. current)
end
if redis.call('TYPE', KEYS[1]).ok ~= 'stream' and redis.call('EXISTS', KEYS[1]) == 1 then
  error(KEYS[1] .. ' is not a stream')
end
check_counter(KEYS[3], ARGV[4])
local added = 0
for i = 7, #ARGV, 3 do
  redis.call('XADD', KEYS[1], '*', 'uid', ARGV[i], 'task', ARGV[i + 1], 'data', ARGV[i + 2],
             'format', '"""
    + FORMAT_VERSION
    + """')
  added = added + 1
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3], ARGV[5], ARGV[6] .. ' ' .. added)
if added > 0 then redis.call('HINCRBY', KEYS[3], ARGV[4], added) end
return added
"""
)


class Scripts:
    """The scripts registered on one client (EVALSHA, reloaded after a server restart)."""

    def __init__(self, client: redis.Redis) -> None:
        self.commit: Script = client.register_script(COMMIT)
        self.commit_logged: Script = client.register_script(COMMIT_LOGGED)
        self.archive_ack: Script = client.register_script(ARCHIVE_ACK)
        self.reclaim: Script = client.register_script(RECLAIM)
        self.touch: Script = client.register_script(TOUCH)
        self.dead_letter_by_hand: Script = client.register_script(DEAD_LETTER_BY_HAND)
        self.claim_bounded: Script = client.register_script(CLAIM_BOUNDED)
        self.feed: Script = client.register_script(FEED)
        self.feed_at_cursor: Script = client.register_script(FEED_AT_CURSOR)
