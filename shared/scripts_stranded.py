"""The scripts that give claims back through no fault of their prompts: a dead producer's
claims handed back to their pools when no producer may be left to reclaim them, and the
delivery given back to claims whose settle Redis refused for the run's fault (a progress
counter that is not a number). shared/scripts.py holds the others and says why scripts."""

from __future__ import annotations

from rollstream.shared.scripts import CHECK_COUNTER_FN, DEAD_LETTER_FN, PRIOR_ATTEMPTS_FN

# KEYS: a pool stream, dead stream, progress hash, fence counter of the stream
# ARGV: group, min idle ms, max attempts, dead progress field, the dead stream's cap
#       (MAXLEN ~), then (owner, id) pairs: claims of producers that are gone (no liveness key)
# Hands a dead producer's idle claims back to their pool when no producer may be left to
# reclaim them (producers are named by pid: a restarted one never sees its own): each claim
# still pending for that owner and idle at least min idle is acked, deleted and appended
# again, its fields unchanged but `attempts` = the deliveries it had, so that it is claimed
# afresh and still counts towards max_attempts; one with max_attempts deliveries already
# (a claim that kills producers) and one deleted while pending become dead letters,
# counted in `dead`. Bumps the fence first (a settle of the owner, were it alive after all,
# writes nothing). Returns {handed back, dead-lettered}.
HAND_BACK = (
    DEAD_LETTER_FN
    + CHECK_COUNTER_FN
    + PRIOR_ATTEMPTS_FN
    + """
check_counter(KEYS[3], ARGV[4])
local max_attempts, cap = tonumber(ARGV[3]), ARGV[5]
local handed, dead, fenced = 0, 0, false
for i = 6, #ARGV, 2 do
  local owner, id = ARGV[i], ARGV[i + 1]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[2], id, id, 1, owner)
  if #p > 0 then
    if not fenced then
      redis.call('INCR', KEYS[4])
      fenced = true
    end
    local entry = redis.call('XRANGE', KEYS[1], id, id)[1]
    redis.call('XACK', KEYS[1], ARGV[1], id)
    if not entry then
      dead_letter(KEYS[2], KEYS[1], id, 'deleted while pending', p[1][4], nil, cap)
      dead = dead + 1
    else
      local deliveries = p[1][4] + prior_attempts(entry[2])
      redis.call('XDEL', KEYS[1], id)
      if deliveries + 1 > max_attempts then
        local reason = 'delivered ' .. deliveries .. ' times to producers that died, and max_attempts is '
          .. max_attempts
        dead_letter(KEYS[2], KEYS[1], id, reason, deliveries, entry[2], cap)
        dead = dead + 1
      else
        local args = {}
        for j = 1, #entry[2], 2 do
          if entry[2][j] ~= 'attempts' then
            args[#args + 1] = entry[2][j]
            args[#args + 1] = entry[2][j + 1]
          end
        end
        args[#args + 1] = 'attempts'
        args[#args + 1] = deliveries
        redis.call('XADD', KEYS[1], '*', unpack(args))
        handed = handed + 1
      end
    end
  end
end
if dead > 0 and ARGV[4] ~= '' then redis.call('HINCRBY', KEYS[3], ARGV[4], dead) end
return {handed, dead}
"""
)

# KEYS: a pool stream
# ARGV: group, consumer, ids...
# A settle refused for a reason that is the run's, not the claims' (a progress counter that
# is not a number): the claims still pending for this consumer get their delivery back
# (RETRYCOUNT one less, idle time kept), so that the restart that follows the repair does
# not charge them for it. Returns how many it gave back.
UNCHARGE = """
local done = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p > 0 then
    local retries = math.max(0, p[1][4] - 1)
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', p[1][3],
               'RETRYCOUNT', retries, 'JUSTID')
    done = done + 1
  end
end
return done
"""
