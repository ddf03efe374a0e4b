-- dlock acquire: take or re-enter a lock, minting a fencing token on a first acquisition.
-- KEYS[1] lock hash  `dlock:{E}`        fields: owner -> hold count, ':fence' -> token
-- KEYS[2] fence key  `dlock:{E}:fence`  last token handed out for this name
-- ARGV[1] owner id, ARGV[2] ttl in ms, ARGV[3] fence key ttl in ms
-- Returns {1, token, count} when the caller holds the lock, {0, pttl} when another owner does.
-- (Every redis.call costs about a microsecond of server time, so the common paths use few.)
local pttl = redis.call('PTTL', KEYS[1])
if pttl == -2 then
  -- The token is max(last + 1, server time in microseconds): it keeps increasing across a
  -- restart without persistence and a failover to a replica that never saw `last`.
  local t = redis.call('TIME')
  local token = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local s = string.format('%d', token)
  local last = tonumber(redis.call('SET', KEYS[2], s, 'PX', ARGV[3], 'GET') or '0') or 0
  if last >= token then
    token = last + 1
    s = string.format('%d', token)
    redis.call('SET', KEYS[2], s, 'PX', ARGV[3])
  end
  redis.call('HSET', KEYS[1], ARGV[1], 1, ':fence', s)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, token, 1}
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  local count = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
  if pttl < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  local token = tonumber(redis.call('HGET', KEYS[1], ':fence') or '0') or 0
  return {1, token, count}
end
return {0, pttl}
