-- dlock fair acquire: take or re-enter a lock in arrival order (`Lock::fair`).
-- KEYS[1] lock hash    `dlock:{E}`      as in acquire.lua
-- KEYS[2] fence key    `dlock:{E}:fence`
-- KEYS[3] fair queue   `dlock:{E}:fq`   zset: owner id -> arrival number (1, 2, ...)
-- KEYS[4] heartbeats   `dlock:{E}:fh`   hash: owner id -> heartbeat deadline (server ms)
-- ARGV[1] owner id, ARGV[2] ttl in ms (a positive integer of at most 14 digits),
-- ARGV[3] fence key ttl in ms, ARGV[4] heartbeat lease in ms (a positive integer),
-- ARGV[5] release channel `dlock:{E}:rel`
-- A re-entry is granted as by acquire.lua. Otherwise queued owners at the head whose heartbeat
-- deadline has passed by the server's clock (their process died or stopped trying) are dropped,
-- and the lock is granted when it is free and the caller is the head of the queue or nobody is
-- queued; the caller then leaves the queue. Else the caller is queued at the back (first try)
-- or keeps its place, and its heartbeat is set to now + ARGV[4]; when the lock is free but it is
-- another owner's turn, 'f' .. that owner is published (the owner's process wakes it: it may
-- have missed the release, or its predecessor died).
-- Returns as acquire.lua: the token (bulk string) of a grant, {token, count} of a re-entry, or
-- the ms to wait at most (integer): the holder's remaining lease, or, while it is the head's
-- turn, the time left on the head's heartbeat.
local ttl = ARGV[2]
if #ttl > 14 or not string.find(ttl, '^[1-9]%d*$') then
  return redis.error_reply('dlock: ttl out of range')
end
local life = tonumber(ARGV[4])
if not life or life < 1 then
  return redis.error_reply('dlock: heartbeat out of range')
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl ~= -2 and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  local count = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
  if pttl < tonumber(ttl) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  return {redis.call('HGET', KEYS[1], ':fence') or '0', count}
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local head, head_dl
while true do
  local h = redis.call('ZRANGE', KEYS[3], 0, 0)
  if not h[1] then
    break
  end
  local dl = tonumber(redis.call('HGET', KEYS[4], h[1]) or '0')
  if h[1] == ARGV[1] or dl > now then
    head, head_dl = h[1], dl
    break
  end
  redis.call('ZREM', KEYS[3], h[1])
  redis.call('HDEL', KEYS[4], h[1])
end
if pttl == -2 and (not head or head == ARGV[1]) then
  if head then
    redis.call('ZREM', KEYS[3], ARGV[1])
    redis.call('HDEL', KEYS[4], ARGV[1])
  end
  local us = t[2]
  if #us < 6 then
    us = string.rep('0', 6 - #us) .. us
  end
  local token = t[1] .. us
  local last = redis.call('SET', KEYS[2], token, 'PX', ARGV[3], 'GET')
  if last then
    last = tonumber(last)
    if last and last >= tonumber(token) then
      token = string.format('%.0f', last + 1)
      redis.call('SET', KEYS[2], token, 'PX', ARGV[3])
    end
  end
  redis.call('HSET', KEYS[1], ARGV[1], '1', ':fence', token)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return token
end
if not redis.call('ZSCORE', KEYS[3], ARGV[1]) then
  local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
  local n = 1
  if last[2] then
    n = tonumber(last[2]) + 1
  end
  redis.call('ZADD', KEYS[3], n, ARGV[1])
end
redis.call('HSET', KEYS[4], ARGV[1], now + life)
-- Both keys outlive every live heartbeat; an expiry is only ever lengthened.
local keep = 2 * life
for i = 3, 4 do
  if redis.call('PTTL', KEYS[i]) < keep then
    redis.call('PEXPIRE', KEYS[i], keep)
  end
end
if pttl == -2 then
  -- Free, but another owner's turn (the caller would be the head otherwise).
  redis.pcall('PUBLISH', ARGV[5], 'f' .. head)
  local left = head_dl - now
  if left < 1 then
    left = 1
  end
  return left
end
return pttl
