-- dlock fence: raise a name's fence to a token chosen by the caller (Redlock's write-back of the
-- token it granted, the largest among the nodes that answered, so that every later grant on
-- this server gets a larger one).
-- KEYS[1] lock hash  `dlock:{E}`        fields: owner -> hold count, ':fence' -> token
-- KEYS[2] fence key  `dlock:{E}:fence`  last token handed out for this name
-- ARGV[1] owner id, ARGV[2] token (decimal digits, no leading zero), ARGV[3] fence key ttl in ms
-- Returns 1 when, once this ran, every later grant of the name on this server gets a token above
-- ARGV[2]: the name is free here, or `owner` holds it (its hold's ':fence' is raised too, so
-- that a re-entry reports the same token); 0 when another owner holds it (granted before the
-- write, possibly with a smaller token). The fence key is raised in both cases.
-- Tokens are compared as digit strings (length, then bytes): no Lua number is involved.
local tok = ARGV[2]
if #tok > 20 or not string.find(tok, '^[1-9]%d*$') then
  return redis.error_reply('dlock: token out of range')
end
local function below(a)
  return #a < #tok or (#a == #tok and a < tok)
end
local cur = redis.call('GET', KEYS[2])
if not cur or below(cur) then
  redis.call('SET', KEYS[2], tok, 'PX', ARGV[3])
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  local f = redis.call('HGET', KEYS[1], ':fence')
  if not f or below(f) then
    redis.call('HSET', KEYS[1], ':fence', tok)
  end
  return 1
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 1
end
return 0
