-- dlock semaphore acquire: take `permits` of a semaphore for an owner, with a lease judged by
-- the server's clock, minting a fencing token per grant.
-- KEYS[1] semaphore hash `dlock:sem:{E}`  fields: ':max' -> max, ':used' -> permits held,
--                                          owner -> that owner's permits, ':t:' .. owner -> the
--                                          token of that owner's grant (read by `dlock show`)
-- KEYS[2] leases `dlock:sem:{E}:z`         zset: owner -> lease end (server ms)
-- KEYS[3] fence `dlock:sem:{E}:fence`      last token handed out for this semaphore
-- ARGV[1] owner id, ARGV[2] max (canonical digits), ARGV[3] permits (1 to max), ARGV[4] ttl in
-- ms (a positive integer of at most 14 digits), ARGV[5] fence key ttl in ms
-- Returns, by reply type:
--   bulk string  the token (decimal digits) of a grant;
--   integer      ms until the first holder's lease ends, when the permits are not free;
--   array        {'max', stored max} when the live holders were granted under another max.
-- Holders whose lease ended are dropped first (their permits come back). With no live holder
-- the name's state is gone, and this grant sets the max. The keys live as long as the longest
-- lease; the fence key outlives them (as a lock's: tokens are max(last + 1, server µs)).
local ttl = ARGV[4]
if #ttl > 14 or not string.find(ttl, '^[1-9]%d*$') then
  return redis.error_reply('dlock: ttl out of range')
end
if not string.find(ARGV[2], '^[1-9]%d*$') or not string.find(ARGV[3], '^[1-9]%d*$') then
  return redis.error_reply('dlock: permits out of range')
end
local max = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
if n > max or max > 4294967295 then
  return redis.error_reply('dlock: permits out of range')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
if #gone > 0 then
  local freed = 0
  for _, o in ipairs(gone) do
    freed = freed + (tonumber(redis.call('HGET', KEYS[1], o) or '0') or 0)
    redis.call('HDEL', KEYS[1], o, ':t:' .. o)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  redis.call('HINCRBY', KEYS[1], ':used', -freed)
end
if redis.call('ZCARD', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[1])
end
local stored = redis.call('HGET', KEYS[1], ':max')
if stored and stored ~= ARGV[2] then
  return {'max', stored}
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  return redis.error_reply('dlock: this owner id already holds permits of the semaphore')
end
local used = tonumber(redis.call('HGET', KEYS[1], ':used') or '0') or 0
if used + n > max then
  local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if first[2] then
    return tonumber(first[2]) - now
  end
  return -1
end
local us = t[2]
if #us < 6 then
  us = string.rep('0', 6 - #us) .. us
end
local token = t[1] .. us
local last = redis.call('SET', KEYS[3], token, 'PX', ARGV[5], 'GET')
if last then
  last = tonumber(last)
  if last and last >= tonumber(token) then
    token = string.format('%.0f', last + 1)
    redis.call('SET', KEYS[3], token, 'PX', ARGV[5])
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3], ':t:' .. ARGV[1], token, ':max', ARGV[2], ':used',
  string.format('%.0f', used + n))
redis.call('ZADD', KEYS[2], now + tonumber(ttl), ARGV[1])
local longest = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
local life = string.format('%.0f', tonumber(longest[2]) - now)
redis.call('PEXPIRE', KEYS[1], life)
redis.call('PEXPIRE', KEYS[2], life)
return token
