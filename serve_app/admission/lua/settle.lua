-- Settle a finished request: reconcile its token reservation with real usage,
-- release its concurrency lease, finalise its record. Idempotent: a request
-- already settled is left as it is.
--
-- KEYS: as admit.lua (1 requests GCRA, 2 tokens GCRA, 3 leases, 4 usage, 5 record)
-- ARGV: 1 request id, 2 final status (completed|failed|cancelled|overloaded|withdrawn), 3 prompt tokens,
--       4 completion tokens, 5 tokens/min limit, 6 record retention s, 7 replica,
--       8 key id, 9 model, 10 day field, 11 month field (both by the ingress's clock:
--       used only for a request admitted without Redis, see below),
--       12-14 its cost in nano-dollars: input, output, reserved (serve_app/accounting/costs.py),
--       15 how many of its prompt tokens the engine had cached (priced apart; counted per model),
--       16 '1': the final record goes on to the record sink (serve_app/accounting/record_shipper.py),
--       17 its HTTP x-request-id and 18 when the ingress admitted it (ms; both used only for a
--       request admitted without Redis, whose record this writes: '' when unknown),
--       19 '1': it takes back an admission still on its way (the client left meanwhile):
--       a record it finds missing was never admitted here, so it is written admission 'none',
--       20 what failed over on its way ('<replica>:<why>,...', 'fallback_from:<model>'; '' none)
--       Prompt tokens -1 = usage unknown (a cancelled stream): the reservation stays charged.
-- Returns the token delta charged (actual - reserved), or false if nothing was done;
-- with ARGV[16] '1', {delta, the final record's fields} (one read, in the same script).
--
-- No record: the request was admitted on the ingress's local limits because
-- Redis did not answer (or its admit call is still on its way). Its real usage
-- is counted, and a final record is written so that a late admit of the same
-- id finds it and changes nothing (admit.lua), whatever order the calls arrive in.

--#include gcra
local WINDOW = 60000
local CACHED_PROMPT = tonumber(ARGV[15] or 0)  -- of the prompt, found in the engine's cache
-- A withdrawn admission (its request admitted again: gatekeeper.py withdraw) is no
-- request's final record: it stays in Redis as a tombstone (a late admit of its id
-- changes nothing) and is never shipped, so the sink holds one record per request.
local SHIP = ARGV[16] == '1' and ARGV[2] ~= 'withdrawn'
-- The team the key was in when the request was admitted (admit.lua keeps it in the
-- record): the usage API reports the key's usage under it, wherever the key is now.
-- A request admitted without Redis has no record, hence no team here: the usage API
-- puts such counters under the key's team of the day they are read.
local TEAM = redis.call('HGET', KEYS[5], 'team') or ''

-- The usage API's counters (serve_app/accounting/usage.py): per model and day, what each
-- request of an inference model was charged: its real usage, or, when that is
-- unknown (a stream the client cancelled), its reservation. A request charged
-- nothing (refused by the model's queue, failed before it ran) is not counted.
-- Its cost likewise, per model and day; and in the day's and month's totals (the
-- money budgets' counters) less what its admission reserved there (``reserved_nanos``).
local function count_for_model(day, month, model, prompt, completion, reserved, reserved_nanos)
  local total = 0
  for i = 1, 3 do total = total + tonumber(ARGV[11 + i] or 0) end
  local delta = total - reserved_nanos
  if delta ~= 0 then
    redis.call('HINCRBY', KEYS[4], day .. ':cost_nanos', string.format('%.0f', delta))
    redis.call('HINCRBY', KEYS[4], month .. ':cost_nanos', string.format('%.0f', delta))
  end
  if model == nil or model == false or model == '' then return end
  local per_model = day .. (TEAM ~= '' and (':team:' .. TEAM) or '') .. ':model:' .. model .. ':'
  if prompt >= 0 then
    if prompt + completion == 0 then return end
    redis.call('HINCRBY', KEYS[4], per_model .. 'input_tokens', prompt)
    redis.call('HINCRBY', KEYS[4], per_model .. 'output_tokens', completion)
    if CACHED_PROMPT > 0 then redis.call('HINCRBY', KEYS[4], per_model .. 'input_cached_tokens', CACHED_PROMPT) end
  else
    redis.call('HINCRBY', KEYS[4], per_model .. 'reserved_tokens', reserved)
  end
  redis.call('HINCRBY', KEYS[4], per_model .. 'requests', 1)
  for i, part in ipairs({'input', 'output', 'reserved'}) do
    if tonumber(ARGV[11 + i] or 0) > 0 then  -- as sent (a string): Lua would print a large number as 1e+15
      redis.call('HINCRBY', KEYS[4], per_model .. 'cost_' .. part .. '_nanos', ARGV[11 + i])
    end
  end
end
local status = redis.call('HGET', KEYS[5], 'status')
if not status then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local prompt, completion = tonumber(ARGV[3]), tonumber(ARGV[4])
  redis.call('HSET', KEYS[5], 'key_id', ARGV[8], 'model', ARGV[9], 'status', ARGV[2],
    'admission', ARGV[19] == '1' and 'none' or 'local', 'finished_ms', now, 'reserved_tokens', 0, 'day', ARGV[10], 'month', ARGV[11])
  if ARGV[17] and ARGV[17] ~= '' then redis.call('HSET', KEYS[5], 'http_request_id', ARGV[17]) end
  if ARGV[18] and ARGV[18] ~= '' then redis.call('HSET', KEYS[5], 'received_ms', ARGV[18]) end
  if prompt >= 0 then
    for _, period in ipairs({ARGV[10], ARGV[11]}) do
      redis.call('HINCRBY', KEYS[4], period .. ':tokens', prompt + completion)
      redis.call('HINCRBY', KEYS[4], period .. ':prompt_tokens', prompt)
      redis.call('HINCRBY', KEYS[4], period .. ':completion_tokens', completion)
    end
    redis.call('HSET', KEYS[5], 'prompt_tokens', prompt, 'completion_tokens', completion,
      'total_tokens', prompt + completion, 'cached_tokens', CACHED_PROMPT)
    count_for_model(ARGV[10], ARGV[11], ARGV[9], prompt, completion, 0, 0)
  end
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('EXPIRE', KEYS[5], tonumber(ARGV[6]))
  if SHIP then return {0, redis.call('HGETALL', KEYS[5])} end
  return 0
end
if status ~= 'admitted' and status ~= 'running' then return false end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local prompt, completion = tonumber(ARGV[3]), tonumber(ARGV[4])
-- The tokens/min limit the request was admitted under (admit.lua keeps it in the record).
local tpm = tonumber(redis.call('HGET', KEYS[5], 'tpm') or ARGV[5])
local reserved = tonumber(redis.call('HGET', KEYS[5], 'reserved_tokens') or 0)
local known = prompt >= 0
local delta = 0
if known then delta = prompt + completion - reserved end

-- Tokens/min: give back what was reserved and not used, as far back as is provable,
-- or charge the excess (gcra.lua).
if tpm > 0 and delta < 0 then
  gcra_give_back(KEYS[2], tpm, -delta, redis.call('HGET', KEYS[5], 'tpm_mark'), now)
elseif tpm > 0 and delta > 0 then
  local state = gcra_state(KEYS[2], now)
  state.tat = state.tat + delta * (WINDOW / tpm)  -- owed since its admission: not from now
  state.charged = state.charged + delta * (WINDOW / tpm)
  gcra_write(KEYS[2], state, now)
end

-- Budgets count in the period the request was admitted in.
local day, month = redis.call('HGET', KEYS[5], 'day'), redis.call('HGET', KEYS[5], 'month')
for _, period in ipairs({day, month}) do
  redis.call('HINCRBY', KEYS[4], period .. ':tokens', delta)
  if known then
    redis.call('HINCRBY', KEYS[4], period .. ':prompt_tokens', prompt)
    redis.call('HINCRBY', KEYS[4], period .. ':completion_tokens', completion)
  end
end

count_for_model(day, month, redis.call('HGET', KEYS[5], 'model'), prompt, completion, reserved,
  tonumber(redis.call('HGET', KEYS[5], 'reserved_nanos') or 0))

redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[5], 'status', ARGV[2], 'finished_ms', now)
if known then
  redis.call('HSET', KEYS[5], 'prompt_tokens', prompt, 'completion_tokens', completion,
    'total_tokens', prompt + completion, 'cached_tokens', CACHED_PROMPT)
else
  redis.call('HSET', KEYS[5], 'total_tokens', reserved, 'usage', 'reserved')
end
if ARGV[7] ~= '' then redis.call('HSET', KEYS[5], 'replica', ARGV[7]) end
if ARGV[20] and ARGV[20] ~= '' then redis.call('HSET', KEYS[5], 'failover', ARGV[20]) end
redis.call('EXPIRE', KEYS[5], tonumber(ARGV[6]))
if SHIP then return {delta, redis.call('HGETALL', KEYS[5])} end
return delta
