-- Writes an election's leader record, fenced by the epoch (see Backend::put_record).
-- KEYS[1]  the record key (`dlock:{<name>}:leader`, a hash: epoch, value)
-- ARGV[1]  the epoch of the writing term (decimal)
-- ARGV[2]  the value
-- Returns 1 when written, 0 when the stored epoch is larger (a later term wrote first).
local cur = redis.call('HGET', KEYS[1], 'epoch')
if cur and tonumber(cur) > tonumber(ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'value', ARGV[2])
return 1
