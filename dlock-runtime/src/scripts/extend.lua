-- dlock extend: set the lease of the caller's hold, owner-checked.
-- KEYS[1] lock hash `dlock:{E}`
-- ARGV[1] owner id, ARGV[2] ttl in ms (a positive integer of at most 14 digits, below 2^48)
-- Returns 1 when extended, 0 when the caller holds nothing (not the owner, or only a
-- hold_at_least remainder with count 0, which must not be extendable).
if #ARGV[2] > 14 or not string.find(ARGV[2], '^[1-9]%d*$') then
  return redis.error_reply('dlock: ttl out of range')
end
local held = redis.call('HGET', KEYS[1], ARGV[1])
if held == '1' or (tonumber(held or '0') or 0) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
