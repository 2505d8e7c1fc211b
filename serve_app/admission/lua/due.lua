-- The due index (redis_names.LEASES_DUE, one zset): account -> when its leases may
-- have expired, so that the reaper (reap.lua) finds the requests a dead ingress left.
-- Mode 'register' (at admission, in the admission's own pipeline; at each renewal):
-- the account is due no earlier than ARGV[3] (ZADD GT: never brought forward).
-- Mode 'reaped': the account was reaped at ARGV[3]; unless it was registered again
-- since (a score past ARGV[3]), it is next due at ARGV[4] (its earliest live lease),
-- or leaves the index (ARGV[4] = -1: no lease left).
-- Mode 'due': the accounts due by now (Redis' clock), ARGV[2] of them at most.
-- KEYS: 1 the due index. ARGV: 1 mode, 2 account id (due: how many), 3 ms, 4 next (reaped only).
if ARGV[1] == 'due' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
end
if ARGV[1] == 'register' then
  return redis.call('ZADD', KEYS[1], 'GT', ARGV[3], ARGV[2])
end
local score = redis.call('ZSCORE', KEYS[1], ARGV[2])
if not score or tonumber(score) > tonumber(ARGV[3]) then return 0 end
if tonumber(ARGV[4]) < 0 then return redis.call('ZREM', KEYS[1], ARGV[2]) end
return redis.call('ZADD', KEYS[1], ARGV[4], ARGV[2])
