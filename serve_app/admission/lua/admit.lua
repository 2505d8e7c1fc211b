-- Admit or refuse one request for one API key, atomically, in one round trip.
--
-- KEYS: 1 requests GCRA state, 2 tokens GCRA state, 3 concurrency leases (zset),
--       4 usage counters (hash), 5 this request's record (hash),
--       6 refusal counters per minute (hash), 7 the account's record (its limits, JSON)
-- ARGV: 1 request id, 2 model, 3 requests/min, 4 tokens/min, 5 max concurrent,
--       6 daily token budget, 7 monthly token budget, 8 tokens to reserve,
--       9 concurrency lease ms, 10 record retention s, 11 key id, 12 HTTP x-request-id
--       (already checked: ours or a short plain id; '' otherwise),
--       13 daily and 14 monthly money budget, 15 this request's reserved cost (all three
--       in nano-dollars, sent as integer strings), 16 '1' when the account's limits are its
--       stored record's (KEYS[7]: an API key, a team), '0' when ARGV's are the only ones
--       (an identity-token user's, from the gateway's configuration), 17 the key's team
--       ('' for none, and at a team's own level), kept in the record for the usage counters,
--       18 '1' when the request's requests/min is already paid: admitted again at its prompt's
--       real size after the replica rendered it (release.lua kept its first admission's
--       cost), so it is neither checked nor charged again, and it is never given back
-- A stored account is admitted under its record as it is in Redis now, not the limits
-- the calling replica cached (ARGV 3-7, 13-14 stand in for a record that has none):
-- a limit lowered or raised applies to the next admission on every replica, and a key
-- or team disabled or revoked is refused ('revoked', never retried). (Records are never
-- deleted, only disabled; where none is found, the caller's limits are applied.)
-- A limit of 0 means unlimited. A team is admitted with this script too (its id for the
-- key id): identity/teams.py.
--
-- Rate limits are GCRA over a 60 s window: a limit L/min admits a burst of L,
-- then one every 60/L s; a request of cost c (1 request, or its reserved
-- tokens) is admitted when the theoretical arrival time after it is at most
-- 60 s ahead of now, so a limit's retry time is exactly when it would pass.
-- Every limit is checked; a refusal names the one with the longest wait and
-- retry_ms is that wait, so retrying after it passes all of them (if nothing
-- else used the quota meanwhile). A request that can never fit (more than the
-- whole tokens/min limit or a whole budget) gets retry_ms -1.
--
-- Nothing is stored per refusal beyond counters: the key's per-minute refusal
-- counts (kept an hour) and the day's refused count in the usage hash. The
-- usage hash keeps 35 days and 13 months of counters (older fields are pruned
-- when a new day starts). Records exist only for admitted requests.
--
-- Returns {admitted(0/1), refusal kind, retry ms, req remaining, req reset ms,
--          tok remaining, tok reset ms, detail, limits}; detail of an admission is the
--          day's and month's budgeted tokens used, "day,month" (keys with a budget);
--          limits: those applied, "rpm,tpm,concurrent,daily,monthly,daily nanos,monthly nanos"
--          when read from the record ('' otherwise).

--#include gcra
--#include refusals
local WINDOW = 60000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local rid, model = ARGV[1], ARGV[2]
local rpm, tpm, max_conc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local daily, monthly = tonumber(ARGV[6]), tonumber(ARGV[7])
local estimate, lease_ms, retention = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local daily_cost, monthly_cost = tonumber(ARGV[13] or 0), tonumber(ARGV[14] or 0)
local cost = tonumber(ARGV[15] or 0)
local applied, revoked = '', false
if ARGV[16] == '1' then
  local raw = redis.call('GET', KEYS[7])
  local stored = raw and cjson.decode(raw)
  if stored and stored.enabled == false then
    revoked = true
  elseif stored then
    local function number(value) return tonumber(value) or 0 end
    rpm, tpm, max_conc = number(stored.requests_per_minute), number(stored.tokens_per_minute),
      number(stored.max_concurrent)
    daily, monthly = number(stored.daily_token_budget), number(stored.monthly_token_budget)
    -- USD to nano-dollars, rounded as the gateway's usd_nanos does.
    daily_cost = math.floor(number(stored.daily_cost_budget_usd) * 1e9 + 0.5)
    monthly_cost = math.floor(number(stored.monthly_cost_budget_usd) * 1e9 + 0.5)
    applied = string.format('%d,%d,%d,%d,%d,%.0f,%.0f', rpm, tpm, max_conc, daily, monthly, daily_cost, monthly_cost)
  end
end

--#include calendar

-- Leases that expired belong to requests whose ingress stopped renewing them (it
-- died): they no longer count (the running count below is of live leases), and the
-- reaper finalises their records (reap.lua, found through the due index: gatekeeper.py).

-- Counters older than the retention are dropped once a day per key.
local function prune_usage()
  local old_day = string.format('d:%04d%02d%02d', civil_from_days(today - 35))
  local old_month = string.format('m:%04d%02d', y - 1, m)
  for _, name in ipairs(redis.call('HKEYS', KEYS[4])) do
    local prefix = string.sub(name, 1, 2)
    if (prefix == 'd:' and name < old_day) or (prefix == 'm:' and name < old_month) then
      redis.call('HDEL', KEYS[4], name)
    end
  end
  redis.call('EXPIRE', KEYS[4], 400 * 86400)
end

-- GCRA state of one limit for a request of `cost`.
local function gcra(key, limit, cost)
  if limit <= 0 then return {ok = true, unlimited = true} end
  local T = WINDOW / limit
  local state = gcra_state(key, now)
  local tat = math.max(state.tat, now)
  local new_tat = tat + cost * T
  local s = {T = T, tat = tat, new_tat = new_tat, too_large = cost > limit, state = state}
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

-- A request id is admitted at most once; a record already there changes nothing.
-- Open (admitted, its lease held), it is this same call run again: the client library
-- sent it a second time after its reply was lost (a connection dropped in a failover
-- or a slot move, after the script ran), so the admission stands and is answered
-- again, with the limits' state as it is now (it included). Settled, the call arrives
-- after its ingress gave up waiting for it (a Redis timeout) and settled the id:
-- 'duplicate', its detail the status it was settled as. The same holds for a request
-- the edge sent again (its replica died before answering: cluster/haproxy_edge.py)
-- under the id the edge gave it: its second try takes over the first's admission, so
-- it is charged once, and its lease runs from now (the first's holder stopped renewing
-- it: the reaper must not take it before the new holder's first renewal). Answered kind
-- 'again'.
local prior = redis.call('HGET', KEYS[5], 'status')
if prior then
  if (prior == 'admitted' or prior == 'running') and redis.call('ZSCORE', KEYS[3], rid) then
    redis.call('ZADD', KEYS[3], 'XX', now + lease_ms, rid)
    local r0, k0 = gcra(KEYS[1], rpm, 0), gcra(KEYS[2], tpm, 0)
    return {1, 'again', 0, r0.unlimited and -1 or r0.remaining, r0.reset or 0,
            k0.unlimited and -1 or k0.remaining, k0.reset or 0, ''}
  end
  return {0, 'duplicate', -1, -1, 0, -1, 0, prior}
end
if revoked then return {0, 'revoked', -1, -1, 0, -1, 0, ''} end

-- A render is a request: one admitted again once rendered paid its requests/min then.
local request_paid = ARGV[18] == '1'
local r = gcra(KEYS[1], rpm, request_paid and 0 or 1)
local k = gcra(KEYS[2], tpm, estimate)
local rr, rs, kr, ks = -1, 0, -1, 0
if not r.unlimited then rr, rs = r.remaining, r.reset end
if not k.unlimited then kr, ks = k.remaining, k.reset end

-- Every limit that refuses, keeping the longest wait (-1: never fits, wins).
local kind, wait, detail = nil, -2, ''
local function refuses(this_kind, this_wait, this_detail)
  if wait == -1 then return end
  if this_wait == -1 or this_wait > wait then kind, wait, detail = this_kind, this_wait, this_detail end
end

if k.too_large then refuses('tokens_too_large', -1, tostring(estimate)) end
if not r.ok then refuses('requests', r.retry, tostring(rpm)) end
if not k.ok and not k.too_large then refuses('tokens', k.retry, tostring(estimate)) end
-- A budget refuses only what would spend from it: work that reserves no tokens (listing,
-- reading, deleting, cancelling files, batches and responses) is never refused by a
-- budget, so a tenant over budget can still stop its own work and fetch its results.
local day_used, month_used = 0, 0
if daily > 0 then
  day_used = tonumber(redis.call('HGET', KEYS[4], day_field .. ':tokens') or 0)
  if estimate > daily then refuses('daily_budget', -1, tostring(day_used))
  elseif estimate > 0 and day_used + estimate > daily then
    refuses('daily_budget', next_day_ms - now, tostring(day_used))
  end
end
if monthly > 0 then
  month_used = tonumber(redis.call('HGET', KEYS[4], month_field .. ':tokens') or 0)
  if estimate > monthly then refuses('monthly_budget', -1, tostring(month_used))
  elseif estimate > 0 and month_used + estimate > monthly then
    refuses('monthly_budget', next_month_ms - now, tostring(month_used))
  end
end
-- Money budgets: the day's and month's cost so far (reservations of requests still
-- running included) plus this request's reserved cost.
local function nanos(value) return string.format('%.0f', value) end
if cost <= 0 then daily_cost, monthly_cost = 0, 0 end  -- spends no money: no money budget refuses it
if daily_cost > 0 then
  local spent = tonumber(redis.call('HGET', KEYS[4], day_field .. ':cost_nanos') or 0)
  if cost > daily_cost then refuses('daily_cost_budget', -1, nanos(spent))
  elseif spent + cost > daily_cost then refuses('daily_cost_budget', next_day_ms - now, nanos(spent)) end
end
if monthly_cost > 0 then
  local spent = tonumber(redis.call('HGET', KEYS[4], month_field .. ':cost_nanos') or 0)
  if cost > monthly_cost then refuses('monthly_cost_budget', -1, nanos(spent))
  elseif spent + cost > monthly_cost then refuses('monthly_cost_budget', next_month_ms - now, nanos(spent)) end
end
if max_conc > 0 then
  local running = redis.call('ZCOUNT', KEYS[3], '(' .. now, '+inf')
  -- No clock says when a running request ends: 1 s is a polling hint.
  if running >= max_conc then refuses('concurrency', 1000, tostring(running)) end
end

if kind then
  count_refusal(KEYS[6], kind, now)
  if redis.call('HINCRBY', KEYS[4], day_field .. ':refused', 1) == 1 then prune_usage() end
  return {0, kind, wait, rr, rs, kr, ks, detail, applied}
end

-- Admitted: commit every limit at once (counters first: nothing below can fail
-- on values the gateway checked, and a lease is never left without a record).
day_used = redis.call('HINCRBY', KEYS[4], day_field .. ':tokens', estimate)
if redis.call('HINCRBY', KEYS[4], day_field .. ':requests', 1) == 1 then prune_usage() end
month_used = redis.call('HINCRBY', KEYS[4], month_field .. ':tokens', estimate)
redis.call('HINCRBY', KEYS[4], month_field .. ':requests', 1)
if cost > 0 then  -- settle.lua replaces it with the real cost
  redis.call('HINCRBY', KEYS[4], day_field .. ':cost_nanos', ARGV[15])
  redis.call('HINCRBY', KEYS[4], month_field .. ':cost_nanos', ARGV[15])
end
-- Each rate limit's mark goes in the record: what a give-back of this request may
-- assume (gcra.lua).
local rpm_mark, tpm_mark = '', ''
if not r.unlimited and not request_paid then rpm_mark = gcra_charge(KEYS[1], r.state, rpm, 1, now) end
if not k.unlimited then tpm_mark = gcra_charge(KEYS[2], k.state, tpm, estimate, now) end
redis.call('HSET', KEYS[5], 'key_id', ARGV[11], 'model', model, 'status', 'admitted',
  'received_ms', now, 'reserved_tokens', estimate, 'day', day_field, 'month', month_field,
  'http_request_id', ARGV[12], 'reserved_nanos', ARGV[15] or '0', 'rpm', rpm, 'tpm', tpm,
  'rpm_mark', rpm_mark, 'tpm_mark', tpm_mark)
if ARGV[17] and ARGV[17] ~= '' then redis.call('HSET', KEYS[5], 'team', ARGV[17]) end
redis.call('EXPIRE', KEYS[5], retention)
redis.call('ZADD', KEYS[3], now + lease_ms, rid)
redis.call('PEXPIRE', KEYS[3], lease_ms + WINDOW)
-- Budget use (this request's reservation included), for the budget-use metric.
local used = ''
if daily > 0 or monthly > 0 then used = day_used .. ',' .. month_used end
return {1, '', 0, rr, rs, kr, ks, used, applied}
