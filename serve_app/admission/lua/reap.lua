-- Finalise the requests of one account (a key or a team) whose leases expired: their
-- ingress died (it renews every third of the lease while it serves them), so their
-- records become final ('abandoned', the reservation charged: the tokens it had
-- generated were never counted) and leave the leases. The one place a request no
-- ingress settles is finalised (serve_app/admission/gatekeeper.py reap_abandoned runs it
-- for the accounts the due index says may have some).
--
-- KEYS: 1 the account's leases (zset), 2 its usage counters (hash)
-- ARGV: 1 the prefix of its request records, 2 how long a final record stays in Redis (s),
--       3 '1': return the final records (to ship them to the record sink)
-- Returns {the earliest live lease's expiry (ms, -1: none left), {id, fields, id, fields, ...},
--          when it reaped (Redis' clock, ms)}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local finals = {}
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 500)
for _, id in ipairs(expired) do
  local rec = ARGV[1] .. id
  local status = redis.call('HGET', rec, 'status')
  if status == 'admitted' or status == 'running' then
    local reserved = tonumber(redis.call('HGET', rec, 'reserved_tokens') or 0)
    redis.call('HSET', rec, 'status', 'abandoned', 'finished_ms', now, 'usage', 'reserved',
      'total_tokens', reserved)
    -- Its model's day counts it as settle.lua counts a request whose usage is unknown.
    local rec_model, rec_day = redis.call('HGET', rec, 'model'), redis.call('HGET', rec, 'day')
    if rec_model and rec_model ~= '' and rec_day then
      local rec_team = redis.call('HGET', rec, 'team')
      local per_model = rec_day .. (rec_team and (':team:' .. rec_team) or '') .. ':model:' .. rec_model .. ':'
      redis.call('HINCRBY', KEYS[2], per_model .. 'requests', 1)
      redis.call('HINCRBY', KEYS[2], per_model .. 'reserved_tokens', reserved)
      local reserved_nanos = redis.call('HGET', rec, 'reserved_nanos')
      if reserved_nanos and reserved_nanos ~= '0' then
        redis.call('HINCRBY', KEYS[2], per_model .. 'cost_reserved_nanos', reserved_nanos)
      end
    end
    redis.call('EXPIRE', rec, tonumber(ARGV[2]))
    if ARGV[3] == '1' then
      table.insert(finals, id)
      table.insert(finals, redis.call('HGETALL', rec))
    end
  end
  redis.call('ZREM', KEYS[1], id)
end
local next_lease = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {next_lease[2] and math.floor(tonumber(next_lease[2])) or -1, finals, now}
