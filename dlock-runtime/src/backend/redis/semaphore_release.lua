-- dlock semaphore release: give back every permit of an owner, owner-checked, and wake as many
-- waiters as permits came back, across all processes.
-- KEYS[1] semaphore hash `dlock:sem:{E}`, KEYS[2] leases `dlock:sem:{E}:z`, KEYS[3] waiters
-- `dlock:sem:{E}:q`, KEYS[4] wants `dlock:sem:{E}:qn` (see semaphore_acquire.lua)
-- ARGV[1] owner id, ARGV[2] release channel `dlock:sem:{E}:rel`
-- Returns -1 when the owner holds no live permit (never granted, released, or its lease ended
-- by the server's clock), 0 when its permits were given back. The owner also leaves the waiters
-- (a wait that ended without a grant). With k permits back (the owner's and those of leases
-- found ended), the first waiters whose heartbeat is live and whose permits fit into k (in the
-- order of their last try) are taken out and each woken with 'f' .. owner (its process wakes
-- exactly that waiter); when no live waiter is queued, or permits are left over and every live
-- waiter was woken, 'p' .. left is published (every process wakes that many of its waiters).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('ZREM', KEYS[3], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[4], ARGV[1])
end
local freed = 0
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
if #gone > 0 then
  for _, o in ipairs(gone) do
    freed = freed + (tonumber(redis.call('HGET', KEYS[1], o) or '0') or 0)
    redis.call('HDEL', KEYS[1], o, ':t:' .. o)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
end
local mine = redis.call('HGET', KEYS[1], ARGV[1])
local r = -1
if mine and redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[1], ARGV[1], ':t:' .. ARGV[1])
  freed = freed + (tonumber(mine) or 0)
  r = 0
end
if freed == 0 then
  return r
end
if redis.call('ZCARD', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
else
  redis.call('HINCRBY', KEYS[1], ':used', -freed)
end
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
if #lapsed > 0 then
  for _, o in ipairs(lapsed) do
    redis.call('HDEL', KEYS[4], o)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
end
local scan = 64
local waiters = redis.call('ZRANGE', KEYS[3], 0, scan - 1)
local left = freed
local skipped = false
for _, o in ipairs(waiters) do
  local n = tonumber(redis.call('HGET', KEYS[4], o) or '1') or 1
  if n <= left then
    redis.call('ZREM', KEYS[3], o)
    redis.call('HDEL', KEYS[4], o)
    redis.pcall('PUBLISH', ARGV[2], 'f' .. o)
    left = left - n
    if left == 0 then
      break
    end
  else
    skipped = true
  end
end
if left > 0 and not skipped and #waiters < scan then
  redis.pcall('PUBLISH', ARGV[2], 'p' .. string.format('%.0f', left))
end
return r
