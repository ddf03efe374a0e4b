-- dlock acquire: take or re-enter a lock, minting a fencing token on a first acquisition.
-- KEYS[1] lock hash  `dlock:{E}`        fields: owner -> hold count, ':fence' -> token
-- KEYS[2] fence key  `dlock:{E}:fence`  last token handed out for this name
-- ARGV[1] owner id, ARGV[2] ttl in ms, ARGV[3] fence key ttl in ms (both integers in 1..2^48)
-- Returns {1, token, count} when the caller holds the lock, {0, pttl} when another owner does.
-- (Every redis.call costs about a microsecond of server time, so the common paths use few.
-- Numbers go to redis.call as Lua numbers: integers below 2^53 reach Redis exactly, so no
-- string.format is needed.)
local ttl, fttl = tonumber(ARGV[2]), tonumber(ARGV[3])
if not ttl or not fttl or ttl < 1 or fttl < 1 or ttl > 281474976710656 or fttl > 281474976710656
    or ttl % 1 ~= 0 or fttl % 1 ~= 0 then
  return redis.error_reply('dlock: ttl out of range')
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl == -2 then
  -- The token is max(last + 1, server time in microseconds): it keeps increasing across a
  -- restart without persistence and a failover to a replica that never saw `last`.
  local t = redis.call('TIME')
  local token = t[1] * 1000000 + t[2]
  local last = tonumber(redis.call('SET', KEYS[2], token, 'PX', fttl, 'GET') or '0') or 0
  if last >= token then
    token = last + 1
    redis.call('SET', KEYS[2], token, 'PX', fttl)
  end
  redis.call('HSET', KEYS[1], ARGV[1], 1, ':fence', token)
  redis.call('PEXPIRE', KEYS[1], ttl)
  return {1, token, 1}
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  local count = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
  if pttl < ttl then
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
  return {1, tonumber(redis.call('HGET', KEYS[1], ':fence') or '0') or 0, count}
end
return {0, pttl}
