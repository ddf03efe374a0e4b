-- dlock semaphore extend: set the lease of an owner's permits, owner-checked, by server time.
-- KEYS[1] semaphore hash `dlock:sem:{E}`, KEYS[2] leases `dlock:sem:{E}:z`
-- ARGV[1] owner id, ARGV[2] ttl in ms (a positive integer of at most 14 digits)
-- Returns 1 when extended, 0 when the owner holds no live permit (its lease ended by the
-- server's clock, or it was released or evicted).
if #ARGV[2] > 14 or not string.find(ARGV[2], '^[1-9]%d*$') then
  return redis.error_reply('dlock: ttl out of range')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not score or tonumber(score) <= now or redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  return 0
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
local longest = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
local life = string.format('%.0f', tonumber(longest[2]) - now)
redis.call('PEXPIRE', KEYS[1], life)
redis.call('PEXPIRE', KEYS[2], life)
return 1
