-- dlock release: give back one hold, owner-checked.
-- KEYS[1] lock hash `dlock:{E}`
-- ARGV[1] owner id, ARGV[2] keep-for in ms (0: delete now), ARGV[3] release channel `dlock:{E}:rel`
-- ('' publishes nothing: Redlock's clean-up of a failed try while another owner holds a quorum),
-- ARGV[4] '1' to give back every hold of the owner (the outermost guard), '0' for one
-- KEYS[2] (optional) waiters' queue `dlock:{E}:q` (see acquire.lua); ARGV[5] (optional) the
-- releasing process's id when it has waiters of its own for the name, ARGV[6] how long its entry
-- lives at least (ms). With KEYS[2], a freeing release queues the releasing process when ARGV[5]
-- is given (at the back), then pops the queue's head whose entry is still live by the server's clock
-- (stale ones, of processes that died or stopped waiting, are dropped on the way) and publishes
-- 'w' .. its id: only that process wakes a waiter; the others only arm a stall timer, stopped by
-- the 't' of the next try (acquire.lua). When others remain queued, that turn is recorded in the
-- queue as its first member, '~' .. id with score -(server ms of the wake), so that a turn whose
-- process does not try is passed on once, by the server's clock (wake.lua); every pop drops the
-- record it finds first. With no live entry it publishes '1' (every process
-- wakes one waiter, as without KEYS[2]). The queue's commands run by pcall: a user whose ACL lacks
-- them (zadd zpopmin zrange) still releases, and its release wakes every process as before.
-- Returns -1 when the caller is not the owner (nothing changed), the remaining hold count when
-- holds remain, 0 when the lock was freed (deleted and one wake-up published, or kept until
-- keep-for runs out, without a wake-up). ARGV[2] must be 0 or a positive integer of at most 14
-- digits (below 2^48).
-- (Strings are compared and passed on as they came: see the cost notes in acquire.lua.)
local keep = ARGV[2]
if keep ~= '0' and (#keep > 14 or not string.find(keep, '^[1-9]%d*$')) then
  return redis.error_reply('dlock: keep-for out of range')
end
local held = redis.call('HGET', KEYS[1], ARGV[1])
if held ~= '1' and (tonumber(held or '0') or 0) <= 0 then
  return -1
end
local count = 0
if ARGV[4] ~= '1' then
  count = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
end
if count > 0 then
  return count
end
if keep ~= '0' then
  redis.call('HSET', KEYS[1], ARGV[1], '0')
  redis.call('PEXPIRE', KEYS[1], keep)
  return 0
end
redis.call('DEL', KEYS[1])
-- pcall: a user without channel permission (ACL) must still release; its waiters fall back to
-- the holder's lease timer. The DEL above has already happened and is not rolled back.
if ARGV[3] ~= '' then
  local msg = '1'
  if KEYS[2] then
    local now
    if ARGV[5] then
      -- At the back: behind the last entry even when that one lives longer.
      local t = redis.call('TIME')
      now = t[1] * 1000 + math.floor(t[2] / 1000)
      local score = now + tonumber(ARGV[6])
      local last = redis.pcall('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
      if not last.err and last[2] and tonumber(last[2]) >= score then
        score = tonumber(last[2]) + 1
      end
      redis.pcall('ZADD', KEYS[2], score, ARGV[5])
      redis.pcall('PEXPIRE', KEYS[2], score - now)
    end
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
  end
  redis.pcall('PUBLISH', ARGV[3], msg)
end
return 0
