-- Whether one more request of an account passes its requests/min and concurrency
-- limits now, charging nothing: asked before a large body is read and parsed
-- (serve_app/http/request_handling.py), so that a key at those limits costs the
-- gateway no more than a 429. Its checks are admit.lua's, on the same state; a
-- request that passes is admitted (or refused) by admit.lua once its body is read.
-- A refusal here is counted as admit.lua counts one (per minute, and the day's
-- refused count); nothing else is written.
--
-- KEYS: as admit.lua (1 requests GCRA, 2 tokens GCRA, 3 leases, 4 usage, 6 refusal
--       counters per minute, 7 the account's record; 5 unused)
-- ARGV: 1 requests/min, 2 max concurrent, 3 '1' when the account's limits are its
--       stored record's (admit.lua's ARGV 17), 4 tokens/min
-- Returns {room(0/1), refusal kind, retry ms, req remaining, req reset ms, tok remaining,
--          tok reset ms, detail, limits} as admit.lua's (limits: "rpm,tpm,..." read
--          from the record, '' otherwise).

--#include gcra
--#include refusals
local WINDOW = 60000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
--#include calendar

local rpm, max_conc, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
local applied = ''
if ARGV[3] == '1' then
  local raw = redis.call('GET', KEYS[7])
  local stored = raw and cjson.decode(raw)
  if stored and stored.enabled == false then return {1, '', 0, -1, 0, -1, 0, '', ''} end  -- admit.lua: 'revoked'
  if stored then
    local function number(value) return tonumber(value) or 0 end
    rpm, tpm, max_conc = number(stored.requests_per_minute), number(stored.tokens_per_minute),
      number(stored.max_concurrent)
    applied = string.format('%d,%d,%d,%d,%d,%.0f,%.0f', rpm, tpm, max_conc, number(stored.daily_token_budget),
      number(stored.monthly_token_budget), math.floor(number(stored.daily_cost_budget_usd) * 1e9 + 0.5),
      math.floor(number(stored.monthly_cost_budget_usd) * 1e9 + 0.5))
  end
end

-- Each limit's state as admit.lua reports it, for the 429's headers.
local function state(key, limit, cost)
  if limit <= 0 then return -1, 0, true, 0 end
  local T = WINDOW / limit
  local tat = math.max(gcra_state(key, now).tat, now)
  local ok = tat + cost * T - now <= WINDOW
  local at = ok and tat + cost * T or tat
  return math.floor((WINDOW - (at - now)) / T), math.ceil(at - now), ok, math.ceil(tat + cost * T - WINDOW - now)
end
local rr, rs, r_ok, r_retry = state(KEYS[1], rpm, 1)
local kr, ks = state(KEYS[2], tpm, 0)

local kind, wait, detail = nil, 0, ''
if not r_ok then kind, wait, detail = 'requests', r_retry, tostring(rpm) end
if max_conc > 0 then
  local running = redis.call('ZCOUNT', KEYS[3], '(' .. now, '+inf')
  if running >= max_conc and (not kind or wait < 1000) then kind, wait, detail = 'concurrency', 1000, tostring(running) end
end
if not kind then return {1, '', 0, rr, rs, kr, ks, '', applied} end

count_refusal(KEYS[6], kind, now)
redis.call('HINCRBY', KEYS[4], day_field .. ':refused', 1)
return {0, kind, wait, rr, rs, kr, ks, detail, applied}
