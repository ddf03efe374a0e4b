-- dlock semaphore release: give back every permit of an owner, owner-checked, and wake as many
-- waiters as permits came back.
-- KEYS[1] semaphore hash `dlock:sem:{E}`, KEYS[2] leases `dlock:sem:{E}:z` (see
-- semaphore_acquire.lua)
-- ARGV[1] owner id, ARGV[2] release channel `dlock:sem:{E}:rel`
-- Returns -1 when the owner holds no live permit (never granted, released, or its lease ended
-- by the server's clock), 0 when its permits were given back. Publishes 'p' .. k on the channel,
-- k the permits that came back (the owner's and those of leases found ended): every process
-- wakes k of its waiters.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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
redis.pcall('PUBLISH', ARGV[2], 'p' .. string.format('%.0f', freed))
return r
