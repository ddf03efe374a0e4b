-- dlock wake: a process leaves a name's waiters' queue and passes on a wake-up it cannot use, or
-- passes on a turn whose process did not try in time (stopped, dead, or slow).
-- KEYS[1] lock hash `dlock:{E}`, KEYS[2] waiters' queue `dlock:{E}:q` (see acquire.lua; its
-- first member may be the turn record '~' .. id, score -(server ms), of the last process a
-- release woke while others stayed queued: see release.lua)
-- ARGV[1] the process's id, ARGV[2] release channel `dlock:{E}:rel`, ARGV[3] the mode:
--   '1' leave, and pass a wake-up on: when the name is free, the next live process in the queue
--       is woken as a release would have (release.lua), or every process ('1') when none is
--       queued;
--   '0' only leave;
--   's' the caller heard process ARGV[4] woken and saw no try of it for ARGV[5] ms (a positive
--       integer): when the name is still free and the turn record still names ARGV[4], woken at
--       least ARGV[5] ms ago by the server's clock, the next live process is woken instead (the
--       caller stays queued). Every waiting process asks when its stall timer runs out; the
--       first passes the turn on, the others find it passed.
-- Returns 1 when it published; 0 when nothing was to do (left only, the name is taken, or the
-- turn moved on); in mode 's', 2 when there is no turn record (nobody else was queued when the
-- process was woken, or a release by an older version: the caller wakes a waiter of its own, as
-- before turns were recorded) and -n when the turn is n ms too young to pass (the caller asks
-- again then).
local now
if ARGV[3] == 's' then
  if redis.call('EXISTS', KEYS[1]) == 1 then
    return 0
  end
  local f = redis.pcall('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if f.err or not f[1] or string.byte(f[1]) ~= 126 then
    return 2
  end
  if string.sub(f[1], 2) ~= ARGV[4] then
    return 0
  end
  local t = redis.call('TIME')
  now = t[1] * 1000 + math.floor(t[2] / 1000)
  local early = tonumber(ARGV[5]) - (now + tonumber(f[2]))
  if early > 0 then
    return -early
  end
else
  redis.pcall('ZREM', KEYS[2], ARGV[1])
  if ARGV[3] ~= '1' or redis.call('EXISTS', KEYS[1]) == 1 then
    -- A turn record left alone names nobody to pass to: it goes with the last entry.
    if redis.pcall('ZCARD', KEYS[2]) == 1 then
      local f = redis.pcall('ZRANGE', KEYS[2], 0, 0)
      if not f.err and f[1] and string.byte(f[1]) == 126 then
        redis.pcall('DEL', KEYS[2])
      end
    end
    return 0
  end
end
local msg = '1'
while true do
  local h = redis.pcall('ZPOPMIN', KEYS[2])
  if h.err or not h[1] then
    break
  end
  if not now then
    local t = redis.call('TIME')
    now = t[1] * 1000 + math.floor(t[2] / 1000)
  end
  if string.byte(h[1]) ~= 126 and tonumber(h[2]) > now then
    msg = 'w' .. h[1]
    if redis.pcall('EXISTS', KEYS[2]) == 1 then
      redis.pcall('ZADD', KEYS[2], -now, '~' .. h[1])
    end
    break
  end
end
redis.pcall('PUBLISH', ARGV[2], msg)
return 1
