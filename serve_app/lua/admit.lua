-- Admit or refuse one request for one API key, atomically, in one round trip.
--
-- KEYS: 1 requests GCRA state, 2 tokens GCRA state, 3 concurrency leases (zset),
--       4 usage counters (hash), 5 this request's record (hash)
-- ARGV: 1 request id, 2 model, 3 requests/min, 4 tokens/min, 5 max concurrent,
--       6 daily token budget, 7 monthly token budget, 8 tokens to reserve,
--       9 concurrency lease ms, 10 record retention s, 11 key id, 12 HTTP x-request-id
-- A limit of 0 means unlimited.
--
-- Rate limits are GCRA over a 60 s window: a limit L/min admits a burst of L,
-- then one every 60/L s; a request of cost c (1 request, or its reserved
-- tokens) is admitted when the theoretical arrival time after it is at most
-- 60 s ahead of now, so `retry_ms` is exactly when it would pass.
--
-- Returns {admitted(0/1), refusal kind, retry ms, req remaining, req reset ms,
--          tok remaining, tok reset ms, detail}; detail of an admission is the
--          day's and month's budgeted tokens used, "day,month" (keys with a budget).

local WINDOW = 60000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local rid, model = ARGV[1], ARGV[2]
local rpm, tpm, max_conc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local daily, monthly = tonumber(ARGV[6]), tonumber(ARGV[7])
local estimate, lease_ms, retention = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])

-- Days since 1970-01-01 <-> civil date (H. Hinnant's algorithms), UTC.
local function civil_from_days(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m, d
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local today = math.floor(now / 86400000)
local y, m, d = civil_from_days(today)
local day_field = string.format('d:%04d%02d%02d', y, m, d)
local month_field = string.format('m:%04d%02d', y, m)
local next_day_ms = (today + 1) * 86400000
local ny, nm = y, m + 1
if nm > 12 then ny, nm = y + 1, 1 end
local next_month_ms = days_from_civil(ny, nm, 1) * 86400000

-- GCRA state of one limit for a request of `cost`.
local function gcra(key, limit, cost)
  if limit <= 0 then return {ok = true, unlimited = true} end
  local T = WINDOW / limit
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  local new_tat = tat + cost * T
  local s = {T = T, tat = tat, new_tat = new_tat, too_large = cost > limit}
  s.ok = (new_tat - now) <= WINDOW
  if s.ok then
    s.remaining = math.floor((WINDOW - (new_tat - now)) / T)
    s.reset = math.ceil(new_tat - now)
  else
    s.remaining = math.floor((WINDOW - (tat - now)) / T)
    s.reset = math.ceil(tat - now)
    s.retry = math.ceil(new_tat - WINDOW - now)
  end
  return s
end

local function header_values(r, k)
  local rr, rs, kr, ks = -1, 0, -1, 0
  if not r.unlimited then rr, rs = r.remaining, r.reset end
  if not k.unlimited then kr, ks = k.remaining, k.reset end
  return rr, rs, kr, ks
end

local function record(status, reason)
  redis.call('HSET', KEYS[5], 'key_id', ARGV[11], 'model', model, 'status', status,
    'received_ms', now, 'reserved_tokens', estimate, 'day', day_field, 'month', month_field,
    'http_request_id', ARGV[12])
  if reason then redis.call('HSET', KEYS[5], 'reason', reason, 'finished_ms', now) end
  redis.call('EXPIRE', KEYS[5], retention)
end

redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local r = gcra(KEYS[1], rpm, 1)
local k = gcra(KEYS[2], tpm, estimate)
local rr, rs, kr, ks = header_values(r, k)

local function refuse(kind, retry_ms, detail)
  record('rejected', kind)
  return {0, kind, retry_ms, rr, rs, kr, ks, detail}
end

if max_conc > 0 then
  local running = redis.call('ZCARD', KEYS[3])
  if running >= max_conc then
    -- No clock says when a running request ends: 1 s is a polling hint.
    return refuse('concurrency', 1000, tostring(running))
  end
end
if not r.ok then return refuse('requests', r.retry, tostring(rpm)) end
if k.too_large then return refuse('tokens_too_large', -1, tostring(estimate)) end
if not k.ok then return refuse('tokens', k.retry, tostring(estimate)) end
if daily > 0 then
  local used = tonumber(redis.call('HGET', KEYS[4], day_field .. ':tokens') or 0)
  if used + estimate > daily then return refuse('daily_budget', next_day_ms - now, tostring(used)) end
end
if monthly > 0 then
  local used = tonumber(redis.call('HGET', KEYS[4], month_field .. ':tokens') or 0)
  if used + estimate > monthly then return refuse('monthly_budget', next_month_ms - now, tostring(used)) end
end

-- Admitted: commit every limit at once.
if not r.unlimited then redis.call('SET', KEYS[1], tostring(r.new_tat), 'PX', math.ceil(r.new_tat - now) + WINDOW) end
if not k.unlimited then redis.call('SET', KEYS[2], tostring(k.new_tat), 'PX', math.ceil(k.new_tat - now) + WINDOW) end
redis.call('ZADD', KEYS[3], now + lease_ms, rid)
redis.call('PEXPIRE', KEYS[3], lease_ms + WINDOW)
local day_used = redis.call('HINCRBY', KEYS[4], day_field .. ':tokens', estimate)
redis.call('HINCRBY', KEYS[4], day_field .. ':requests', 1)
local month_used = redis.call('HINCRBY', KEYS[4], month_field .. ':tokens', estimate)
redis.call('HINCRBY', KEYS[4], month_field .. ':requests', 1)
record('admitted', nil)
-- Budget use (this request's reservation included), for the budget-use metric.
local used = ''
if daily > 0 or monthly > 0 then used = day_used .. ',' .. month_used end
return {1, '', 0, rr, rs, kr, ks, used}
