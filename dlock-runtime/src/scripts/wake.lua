-- dlock wake: a process leaves a name's waiters' queue, and passes on a wake-up it cannot use.
-- KEYS[1] lock hash `dlock:{E}`, KEYS[2] waiters' queue `dlock:{E}:q` (see acquire.lua)
-- ARGV[1] the process's id, ARGV[2] release channel `dlock:{E}:rel`, ARGV[3] '1' to pass a
-- wake-up on: when the name is free, the next live process in the queue is woken as a release
-- would have (release.lua), or every process ('1') when none is queued; '0' only leaves.
-- Returns 1 when it published, 0 otherwise.
redis.pcall('ZREM', KEYS[2], ARGV[1])
if ARGV[3] ~= '1' or redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local msg = '1'
local now
while true do
  local h = redis.pcall('ZPOPMIN', KEYS[2])
  if h.err or not h[1] then
    break
  end
  if not now then
    local t = redis.call('TIME')
    now = t[1] * 1000 + math.floor(t[2] / 1000)
  end
  if tonumber(h[2]) > now then
    msg = 'w' .. h[1]
    break
  end
end
redis.pcall('PUBLISH', ARGV[2], msg)
return 1
