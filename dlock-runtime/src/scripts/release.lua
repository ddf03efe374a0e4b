-- dlock release: give back one hold, owner-checked.
-- KEYS[1] lock hash `dlock:{E}`
-- ARGV[1] owner id, ARGV[2] keep-for in ms (0: delete now), ARGV[3] release channel `dlock:{E}:rel`
-- ('' publishes nothing: Redlock's clean-up of a failed try while another owner holds a quorum),
-- ARGV[4] '1' to give back every hold of the owner (the outermost guard), '0' for one
-- Returns -1 when the caller is not the owner (nothing changed), the remaining hold count when
-- holds remain, 0 when the lock was freed (deleted and one wake-up published, or kept until
-- keep-for runs out, without a wake-up). ARGV[2] must be 0 or a positive integer of at most 14
-- digits (below 2^48).
-- (Strings are compared and passed on as they came: see the cost notes in acquire.lua.)
local keep = ARGV[2]
if keep ~= '0' and (#keep > 14 or not string.find(keep, '^[1-9]%d*$')) then
  return redis.error_reply('dlock: keep-for out of range')
end
local held = redis.call('HGET', KEYS[1], ARGV[1])
if held ~= '1' and (tonumber(held or '0') or 0) <= 0 then
  return -1
end
local count = 0
if ARGV[4] ~= '1' then
  count = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
end
if count > 0 then
  return count
end
if keep ~= '0' then
  redis.call('HSET', KEYS[1], ARGV[1], '0')
  redis.call('PEXPIRE', KEYS[1], keep)
  return 0
end
redis.call('DEL', KEYS[1])
-- pcall: a user without channel permission (ACL) must still release; its waiters fall back to
-- the holder's lease timer. The DEL above has already happened and is not rolled back.
if ARGV[3] ~= '' then
  redis.pcall('PUBLISH', ARGV[3], '1')
end
return 0
