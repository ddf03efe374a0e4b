-- dlock read-write lock: one script for every operation of `RwLock` on one name.
-- KEYS[1] state hash `dlock:{E}:rw`: fields `w` writer owner, `wn` its hold count, `wt` its token,
--         `wx` its lease end (server ms); `q` the waiting writer (writer preference), `qx` its
--         marker's lease end; `c:<owner>` a reader's hold count, `t:<owner>` its token
-- KEYS[2] readers zset `dlock:{E}:rw:r`: reader owner -> its lease end (server ms)
-- KEYS[3] fence key `dlock:{E}:rw:fence`: last token handed out for this name (either side)
-- ARGV[1] operation: 'ar' / 'aw' acquire read / write; 'rr' / 'rw' release read / write;
--         'er' / 'ew' extend read / write; 'dg' downgrade write to read
-- ARGV[2] owner id
-- ARGV[3] ttl in ms (acquire, extend, downgrade: a positive integer of at most 14 digits), or
--         for a release '1' to give back every hold of the owner (and, on the write side, its
--         waiting marker), '0' for one
-- ARGV[4] fence key ttl in ms, ARGV[5] readers' channel `dlock:{E}:rw:rd`, ARGV[6] writers'
--         channel `dlock:{E}:rw:wr`
-- Every lease end is judged by the server's clock (TIME): a reader or a waiting writer that
-- stops renewing is gone once its own lease ends, whatever the others do. Expired holds and
-- markers are purged at the start of every call.
-- Returns:
--   acquire    bulk string token of a first grant (a token larger than every token before for
--              this name, either side: max(last + 1, server time in µs)); {token, count} for a
--              re-entry; an integer (ms) when busy: when to try again at the latest
--   release    -1 not a holder (nothing changed, except a waiting marker of the owner cleared
--              with ARGV[3] = '1'), 0 freed, n > 0 holds left
--   extend     1 extended, 0 not a holder
--   downgrade  bulk string token of the new read hold, or 0 when the owner is not the writer
-- Wake-ups: a freed write side publishes 'a' on the readers' channel (every waiting reader of a
-- process retries) unless a writer waits; it and the last reader out publish on the writers'
-- channel 'o' .. the waiting writer's owner id (its process wakes exactly it, the others their
-- first writer) or '1' (every process wakes one writer); a downgrade publishes 'a' to readers
-- when no writer waits. PUBLISH runs by pcall (an ACL without channel rights still releases;
-- waiters then retry by their leases).
local op = ARGV[1]
local owner = ARGV[2]
local ttl
if op ~= 'rr' and op ~= 'rw' then
  if #ARGV[3] > 14 or not string.find(ARGV[3], '^[1-9]%d*$') then
    return redis.error_reply('dlock: ttl out of range')
  end
  ttl = tonumber(ARGV[3])
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Purge what has expired.
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, o in ipairs(gone) do
  redis.call('HDEL', KEYS[1], 'c:' .. o, 't:' .. o)
end
if #gone > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
end
local st = redis.call('HMGET', KEYS[1], 'w', 'wx', 'q', 'qx')
local writer, wx, waiting, qx = st[1], tonumber(st[2] or '0'), st[3], tonumber(st[4] or '0')
if writer and wx <= now then
  redis.call('HDEL', KEYS[1], 'w', 'wn', 'wt', 'wx')
  writer = false
end
if waiting and qx <= now then
  redis.call('HDEL', KEYS[1], 'q', 'qx')
  waiting = false
end

-- Both keys live at least `ms` more (the longest hold or marker they carry).
local function keep(ms)
  for i = 1, 2 do
    local p = redis.call('PTTL', KEYS[i])
    if p == -1 or (p >= 0 and p < ms) then
      redis.call('PEXPIRE', KEYS[i], ms)
    end
  end
end

local function mint()
  local us = t[2]
  if #us < 6 then
    us = string.rep('0', 6 - #us) .. us
  end
  local token = t[1] .. us
  local last = redis.call('SET', KEYS[3], token, 'PX', ARGV[4], 'GET')
  if last then
    last = tonumber(last)
    if last and last >= tonumber(token) then
      token = string.format('%.0f', last + 1)
      redis.call('SET', KEYS[3], token, 'PX', ARGV[4])
    end
  end
  return token
end

local function busy(ms)
  return math.max(math.floor(ms), 1)
end

if op == 'ar' then
  if writer then
    return busy(wx - now)
  end
  local c = redis.call('HGET', KEYS[1], 'c:' .. owner)
  if c then
    c = redis.call('HINCRBY', KEYS[1], 'c:' .. owner, 1)
    local e = tonumber(redis.call('ZSCORE', KEYS[2], owner) or '0')
    if e < now + ttl then
      redis.call('ZADD', KEYS[2], now + ttl, owner)
    end
    keep(ttl)
    return {redis.call('HGET', KEYS[1], 't:' .. owner) or '0', c}
  end
  if waiting and waiting ~= owner then
    return busy(qx - now)
  end
  local token = mint()
  redis.call('HSET', KEYS[1], 'c:' .. owner, '1', 't:' .. owner, token)
  redis.call('ZADD', KEYS[2], now + ttl, owner)
  keep(ttl)
  return token
end

if op == 'aw' then
  if writer == owner then
    local c = redis.call('HINCRBY', KEYS[1], 'wn', 1)
    if wx < now + ttl then
      redis.call('HSET', KEYS[1], 'wx', now + ttl)
    end
    keep(ttl)
    return {redis.call('HGET', KEYS[1], 'wt') or '0', c}
  end
  local mine = (not waiting) or waiting == owner
  local ends = false
  if writer then
    ends = wx
  end
  local top = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
  if top[2] then
    local r = tonumber(top[2])
    if not ends or r > ends then
      ends = r
    end
  end
  if ends then
    if mine then
      redis.call('HSET', KEYS[1], 'q', owner, 'qx', now + ttl)
      keep(ttl)
    end
    -- Try again before the marker's lease ends, to renew it.
    return busy(math.min(ends - now, ttl / 2))
  end
  if not mine then
    return busy(qx - now)
  end
  if waiting then
    redis.call('HDEL', KEYS[1], 'q', 'qx')
  end
  local token = mint()
  redis.call('HSET', KEYS[1], 'w', owner, 'wn', '1', 'wt', token, 'wx', now + ttl)
  keep(ttl)
  return token
end

if op == 'rr' then
  local c = redis.call('HGET', KEYS[1], 'c:' .. owner)
  if not c then
    return -1
  end
  if ARGV[3] ~= '1' and tonumber(c) > 1 then
    return redis.call('HINCRBY', KEYS[1], 'c:' .. owner, -1)
  end
  redis.call('HDEL', KEYS[1], 'c:' .. owner, 't:' .. owner)
  redis.call('ZREM', KEYS[2], owner)
  if redis.call('ZCARD', KEYS[2]) == 0 then
    redis.pcall('PUBLISH', ARGV[6], waiting and ('o' .. waiting) or '1')
  end
  return 0
end

if op == 'rw' then
  if writer == owner then
    if ARGV[3] ~= '1' then
      local n = tonumber(redis.call('HGET', KEYS[1], 'wn') or '1')
      if n > 1 then
        return redis.call('HINCRBY', KEYS[1], 'wn', -1)
      end
    end
    redis.call('HDEL', KEYS[1], 'w', 'wn', 'wt', 'wx')
    if not waiting then
      redis.pcall('PUBLISH', ARGV[5], 'a')
    end
    redis.pcall('PUBLISH', ARGV[6], waiting and ('o' .. waiting) or '1')
    return 0
  end
  if ARGV[3] == '1' and waiting == owner then
    -- A writer that stopped waiting: readers may go on, the next writer may take its place.
    redis.call('HDEL', KEYS[1], 'q', 'qx')
    redis.pcall('PUBLISH', ARGV[5], 'a')
    redis.pcall('PUBLISH', ARGV[6], '1')
  end
  return -1
end

if op == 'er' then
  if not redis.call('ZSCORE', KEYS[2], owner) then
    return 0
  end
  redis.call('ZADD', KEYS[2], now + ttl, owner)
  keep(ttl)
  return 1
end

if op == 'ew' then
  if writer ~= owner then
    return 0
  end
  redis.call('HSET', KEYS[1], 'wx', now + ttl)
  keep(ttl)
  return 1
end

if op == 'dg' then
  if writer ~= owner then
    return 0
  end
  redis.call('HDEL', KEYS[1], 'w', 'wn', 'wt', 'wx')
  local token = mint()
  redis.call('HSET', KEYS[1], 'c:' .. owner, '1', 't:' .. owner, token)
  redis.call('ZADD', KEYS[2], now + ttl, owner)
  keep(ttl)
  if not waiting then
    redis.pcall('PUBLISH', ARGV[5], 'a')
  end
  return token
end

return redis.error_reply('dlock: unknown read-write operation')
