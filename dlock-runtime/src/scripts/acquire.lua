-- dlock acquire: take or re-enter a lock, minting a fencing token on a first acquisition.
-- KEYS[1] lock hash  `dlock:{E}`        fields: owner -> hold count, ':fence' -> token
-- KEYS[2] fence key  `dlock:{E}:fence`  last token handed out for this name
-- ARGV[1] owner id, ARGV[2] ttl in ms (a positive integer of at most 14 digits, below 2^48),
-- ARGV[3] fence key ttl in ms (a positive integer)
-- KEYS[3] (optional) waiters' queue `dlock:{E}:q` (zset: process id -> expiry in server ms),
-- ARGV[4] the caller's process id, ARGV[5] the release channel: given when the caller's process
-- has waiters for the name (never with the holder flag below). A busy try then queues the process (at the back,
-- live until the holder's lease or the caller's ttl, whichever is longer, plus 2 s), and a busy
-- try or a first acquisition publishes 't' on the channel: the name was looked at after the last
-- release, so the other processes stop their stall timers (see release.lua). ARGV[6] (optional,
-- with KEYS[3]): any value asks a busy answer to name the holder, as below (a Redlock node).
-- Returns, by reply type:
--   bulk string  the token (decimal digits) of a first acquisition: the caller holds it once;
--   array        {token, count} of a re-entry (the caller's hold count after it);
--   integer      the remaining lease in ms (-1: no expiry) when another owner holds the lock;
--   array        {remaining ms, holder's owner id} instead when ARGV[4] is given without KEYS[3],
--                or ARGV[6] with KEYS[3] (Redlock: a failed try tells from it whether one owner
--                holds a quorum of the nodes).
-- Cost notes (server time is what limits throughput; see BENCHMARKS.md): every redis.call
-- costs a few thousand instructions, and so does a Lua number passed to redis.call (Redis
-- formats it with %.17g) or a table returned (Redis probes it for err/ok/map fields). So the
-- ttls go to Redis as the strings they came as, the token is built from TIME's two strings,
-- and a first acquisition returns one string. The ttl is checked by a pattern (cheaper than
-- tonumber, and only canonical digits reach PEXPIRE); the fence ttl is checked by SET itself,
-- which refuses a non-positive or non-integer expiry before anything is written.
local ttl = ARGV[2]
if #ttl > 14 or not string.find(ttl, '^[1-9]%d*$') then
  return redis.error_reply('dlock: ttl out of range')
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl == -2 then
  -- The token is max(last + 1, server time in microseconds): it keeps increasing across a
  -- restart without persistence and a failover to a replica that never saw `last`.
  local t = redis.call('TIME')
  local us = t[2]
  if #us < 6 then
    us = string.rep('0', 6 - #us) .. us
  end
  local token = t[1] .. us
  local last = redis.call('SET', KEYS[2], token, 'PX', ARGV[3], 'GET')
  if last then
    last = tonumber(last)
    if last and last >= tonumber(token) then
      -- Exact: tokens stay below 2^53 until the year 2255.
      token = string.format('%.0f', last + 1)
      redis.call('SET', KEYS[2], token, 'PX', ARGV[3])
    end
  end
  redis.call('HSET', KEYS[1], ARGV[1], '1', ':fence', token)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if KEYS[3] then
    redis.pcall('PUBLISH', ARGV[5], 't')
  end
  return token
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  local count = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
  if pttl < tonumber(ttl) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  return {redis.call('HGET', KEYS[1], ':fence') or '0', count}
end
if KEYS[3] then
  local t = redis.call('TIME')
  local life = tonumber(ttl)
  if pttl > life then
    life = pttl
  end
  life = life + 2000
  -- pcall: a user whose ACL lacks ZADD still gets its busy answer (and is woken by the
  -- releases of others as every process is when nobody is queued).
  redis.pcall('ZADD', KEYS[3], t[1] * 1000 + math.floor(t[2] / 1000) + life, ARGV[4])
  redis.pcall('PEXPIRE', KEYS[3], life)
  redis.pcall('PUBLISH', ARGV[5], 't')
  if not ARGV[6] then
    return pttl
  end
end
if ARGV[4] then
  local ks = redis.call('HKEYS', KEYS[1])
  local o = ks[1]
  if o == ':fence' then
    o = ks[2]
  end
  return {pttl, o or ''}
end
return pttl
