-- The due index (redis_names.LEASES_DUE, one zset): account -> when its leases may
-- have expired, so that the reaper (reap.lua) finds the requests a dead ingress left;
-- beside it (LEASES_SEEN, the same slot) when each account was last registered.
-- A due time is only ever brought forward by a registration, never put off: an
-- account admitted without pause by a live ingress must still have a dead one's
-- requests reaped a lease and a half after their last renewal (postponing it on
-- every registration left them open as long as their key or team stayed busy: the
-- soak found three so, 15 minutes after their ingress was killed).
-- Mode 'register' (at admission, in the admission's own pipeline; at each renewal):
-- the account is due no later than ARGV[3] (ZADD LT), and seen now.
-- Mode 'reaped': the account was reaped at ARGV[3] (Redis' clock, its node); its
-- earliest live lease expires at ARGV[4] (-1: none): due then (sooner if a
-- registration since asks). With none left it leaves the index, unless registered
-- within ARGV[5] ms before the reap: an ingress that registered it then counts on
-- that registration for the leases it takes for a while (it registers an account
-- once per half lease), so the account is looked at again ARGV[6] ms later instead.
-- Mode 'due': the accounts due by now (Redis' clock), ARGV[2] of them at most.
-- KEYS: 1 the due index, 2 when each account was registered last.
-- ARGV: 1 mode, 2 account id (due: how many), 3 ms, 4 next (reaped), 5 guard ms, 6 look again ms.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[1] == 'due' then
  return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
end
if ARGV[1] == 'register' then
  redis.call('ZADD', KEYS[2], 'GT', now, ARGV[2])
  return redis.call('ZADD', KEYS[1], 'LT', ARGV[3], ARGV[2])
end
local reaped_at, next_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
local current = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[2]) or nil)
-- Changed since the reap (another reaper, a registration): only ever brought forward.
local unchanged = current == nil or current <= reaped_at
if next_ms >= 0 then
  if unchanged or next_ms < current then redis.call('ZADD', KEYS[1], next_ms, ARGV[2]) end
  return 1
end
local seen = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[2]) or 0)
if seen > reaped_at - tonumber(ARGV[5]) then
  if unchanged then redis.call('ZADD', KEYS[1], reaped_at + tonumber(ARGV[6]), ARGV[2]) end
  return 1
end
if current ~= nil and current <= reaped_at then
  redis.call('ZREM', KEYS[1], ARGV[2])
  redis.call('ZREM', KEYS[2], ARGV[2])
end
return 0
