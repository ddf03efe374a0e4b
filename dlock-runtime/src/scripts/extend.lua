-- dlock extend: set the lease of the caller's hold, owner-checked.
-- KEYS[1] lock hash `dlock:{E}`
-- ARGV[1] owner id, ARGV[2] ttl in ms
-- Returns 1 when extended, 0 when the caller is no longer the owner.
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
