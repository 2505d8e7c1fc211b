-- Whether one more request of an account passes its requests/min and concurrency
-- limits now, charging nothing: asked before a large body is read and parsed
-- (serve_app/http/request_handling.py), so that a key at those limits costs the
-- gateway no more than a 429. Its checks are admit.lua's, on the same state; a
-- request that passes is admitted (or refused) by admit.lua once its body is read.
-- A refusal here is counted as admit.lua counts one (per minute, and the day's
-- refused count); nothing else is written.
--
-- KEYS: as admit.lua (1 requests GCRA, 3 leases, 4 usage, 6 refusal counters per
--       minute, 7 the account's record; 2 and 5 unused)
-- ARGV: 1 requests/min, 2 max concurrent, 3 '1' when the account's limits are its
--       stored record's (admit.lua's ARGV 17)
-- Returns {room(0/1), refusal kind, retry ms, req remaining, req reset ms, detail}.

--#include gcra
local WINDOW = 60000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
--#include calendar

local rpm, max_conc = tonumber(ARGV[1]), tonumber(ARGV[2])
if ARGV[3] == '1' then
  local raw = redis.call('GET', KEYS[7])
  local stored = raw and cjson.decode(raw)
  if stored and stored.enabled == false then return {1, '', 0, -1, 0, ''} end  -- admit.lua says 'revoked'
  if stored then
    rpm, max_conc = tonumber(stored.requests_per_minute) or 0, tonumber(stored.max_concurrent) or 0
  end
end

local kind, wait, detail, rr, rs = nil, 0, '', -1, 0
if rpm > 0 then
  local T = WINDOW / rpm
  local tat = math.max(gcra_state(KEYS[1], now).tat, now)
  if tat + T - now > WINDOW then  -- admit.lua's gcra(KEYS[1], rpm, 1) is not ok
    kind, wait, detail = 'requests', math.ceil(tat + T - WINDOW - now), tostring(rpm)
    rr, rs = math.floor((WINDOW - (tat - now)) / T), math.ceil(tat - now)
  end
end
if max_conc > 0 then
  local running = redis.call('ZCOUNT', KEYS[3], '(' .. now, '+inf')
  if running >= max_conc and (not kind or wait < 1000) then kind, wait, detail = 'concurrency', 1000, tostring(running) end
end
if not kind then return {1, '', 0, rr, rs, ''} end

local minute = math.floor(now / 60000)
redis.call('HINCRBY', KEYS[6], minute .. ':' .. kind, 1)
redis.call('EXPIRE', KEYS[6], 3660)
redis.call('HINCRBY', KEYS[4], day_field .. ':refused', 1)
return {0, kind, wait, rr, rs, detail}
