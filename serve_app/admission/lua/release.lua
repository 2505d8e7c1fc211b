-- Take back an admission that another level of the same request refused (a key
-- admitted, its team not, or the reverse: admission/gatekeeper.py admits every level at
-- once). Everything admit.lua committed for it is undone, as if it had been
-- refused here: its requests/min and tokens/min cost (as far back as is provable:
-- gcra.lua), its token and money reservations, its lease and its record (a refusal
-- stores nothing: admit.lua);
-- the request counts as refused. Nothing calls admit for the id again, and a
-- settle of it (a client that left meanwhile) finds no record and counts no usage.
--
-- KEYS: as admit.lua (1 requests GCRA, 2 tokens GCRA, 3 leases, 4 usage, 5 record,
--       6 refusal counters per minute)
-- ARGV: 1 request id, 2 requests/min, 3 tokens/min (the limits it was admitted
--       under), 4 the refusal kind, as the other level's ('team_requests', ...), or ''
--       when it is no refusal (an admission withdrawn to be made again at another size:
--       nothing counts it), 5 '1' to keep its requests/min charged: the replica rendered
--       its prompt, found it larger than reserved, and it is admitted again at its real
--       size (admit.lua's ARGV 19), so a render always costs a request of requests/min
-- Returns 1 if it undid an admission, 0 if there was none to undo.

--#include gcra
local WINDOW = 60000
local status = redis.call('HGET', KEYS[5], 'status')
if status ~= 'admitted' and status ~= 'running' then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local reserved = tonumber(redis.call('HGET', KEYS[5], 'reserved_tokens') or 0)
-- Under the limits it was admitted with (kept in the record), where the record has them;
-- no further back than is provable (gcra.lua).
local function limit(field, default) return tonumber(redis.call('HGET', KEYS[5], field) or default) end
if ARGV[5] ~= '1' then
  gcra_give_back(KEYS[1], limit('rpm', ARGV[2]), 1, redis.call('HGET', KEYS[5], 'rpm_mark'), now)
end
gcra_give_back(KEYS[2], limit('tpm', ARGV[3]), reserved, redis.call('HGET', KEYS[5], 'tpm_mark'), now)

local reserved_nanos = redis.call('HGET', KEYS[5], 'reserved_nanos') or '0'
for _, period in ipairs({redis.call('HGET', KEYS[5], 'day'), redis.call('HGET', KEYS[5], 'month')}) do
  redis.call('HINCRBY', KEYS[4], period .. ':tokens', -reserved)
  redis.call('HINCRBY', KEYS[4], period .. ':requests', -1)
  if reserved_nanos ~= '0' then redis.call('HINCRBY', KEYS[4], period .. ':cost_nanos', '-' .. reserved_nanos) end
end
if ARGV[4] ~= '' then
  redis.call('HINCRBY', KEYS[4], redis.call('HGET', KEYS[5], 'day') .. ':refused', 1)
  local minute = math.floor(now / 60000)
  redis.call('HINCRBY', KEYS[6], minute .. ':' .. ARGV[4], 1)
  redis.call('EXPIRE', KEYS[6], 3660)
end

redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[5])
return 1
