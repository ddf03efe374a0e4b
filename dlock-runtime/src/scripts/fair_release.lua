-- dlock fair release: give back holds of a fair lock (`Lock::fair`), owner-checked, and leave
-- its queue; the lock's next turn goes to the queue's first live owner.
-- KEYS[1] lock hash `dlock:{E}`, KEYS[2] fair queue `dlock:{E}:fq`, KEYS[3] heartbeats
-- `dlock:{E}:fh` (see fair_acquire.lua)
-- ARGV[1] owner id, ARGV[2] keep-for in ms (0: delete now), ARGV[3] release channel ('' publishes
-- nothing), ARGV[4] '1' to give back every hold, '0' for one
-- With ARGV[4] '1' the owner also leaves the queue (a wait that ended without a grant, or a try
-- whose answer was lost). When the lock is free afterwards (this release freed it, or it was
-- free and the caller left the queue), the queue's first live owner is woken with 'f' .. owner
-- (owners whose heartbeat ran out by the server's clock are dropped on the way), or every
-- process ('1') when nobody live is queued.
-- Returns as release.lua: -1 not the owner, the remaining hold count, or 0 when freed.
local keep = ARGV[2]
if keep ~= '0' and (#keep > 14 or not string.find(keep, '^[1-9]%d*$')) then
  return redis.error_reply('dlock: keep-for out of range')
end
local function wake()
  if ARGV[3] == '' then
    return
  end
  local msg = '1'
  local now
  while true do
    local h = redis.call('ZRANGE', KEYS[2], 0, 0)
    if not h[1] then
      break
    end
    if not now then
      local t = redis.call('TIME')
      now = t[1] * 1000 + math.floor(t[2] / 1000)
    end
    local dl = tonumber(redis.call('HGET', KEYS[3], h[1]) or '0')
    if dl > now then
      msg = 'f' .. h[1]
      break
    end
    redis.call('ZREM', KEYS[2], h[1])
    redis.call('HDEL', KEYS[3], h[1])
  end
  redis.pcall('PUBLISH', ARGV[3], msg)
end
local held = redis.call('HGET', KEYS[1], ARGV[1])
if held ~= '1' and (tonumber(held or '0') or 0) <= 0 then
  -- Not a holder (a holder left the queue with its grant): leave the queue, and pass the turn
  -- on when it was this owner's and the lock is free.
  if ARGV[4] == '1' and redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
    redis.call('HDEL', KEYS[3], ARGV[1])
    if redis.call('EXISTS', KEYS[1]) == 0 then
      wake()
    end
  end
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
wake()
return 0
