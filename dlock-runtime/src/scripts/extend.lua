-- dlock extend: set the lease of the caller's hold, owner-checked.
-- KEYS[1] lock hash `dlock:{E}`
-- ARGV[1] owner id, ARGV[2] ttl in ms (integer in 1..2^48)
-- Returns 1 when extended, 0 when the caller holds nothing (not the owner, or only a
-- hold_at_least remainder with count 0, which must not be extendable).
local ttl = tonumber(ARGV[2])
if not ttl or ttl < 1 or ttl > 281474976710656 or ttl % 1 ~= 0 then
  return redis.error_reply('dlock: ttl out of range')
end
if (tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') or 0) > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  return 1
end
return 0
