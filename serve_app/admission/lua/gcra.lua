-- One GCRA limit's state (requests/min or tokens/min of one account), shared by
-- admit.lua, release.lua and settle.lua (lua_scripts.py includes it where a script
-- says `--#include gcra`). The string "tat epoch charged":
--   tat      the theoretical arrival time, ms (a double, written exactly: %.17g);
--   epoch    when this state was created (ms): it lives until 60 s past its tat, so
--            two states of one limit never share an epoch;
--   charged  every emission time ever charged to this state, ms (each admission's cost
--            times the emission interval of the limit it was admitted under, and excess
--            usage likewise), never lowered: what a give-back must assume came after.
-- A request's record keeps "epoch:charged" right after its own admission (its mark).
--
-- Why the mark: moving the tat back by what a request cost (a request taken back, or
-- tokens it reserved and did not use) is exact only if no request admitted after it
-- found the tat in the past. GCRA's tat is max(tat, now) + cost·T per admission, so the
-- tat is the max, over the admissions k, of t_k + (the time charged by k and everything
-- after k). With request x taken out, it is the max of (a) today's terms less x's time
-- and (b) those of each k admitted after x, each at most now + (time charged since x).
-- Giving back down to max of the two is never more than taking x out of history would,
-- whatever limit each request came under (a limit changed meanwhile included), so the
-- window bound L + L·s/60 holds on what the records say each request cost (property
-- test: tests/integration/test_gcra_give_back.py; found by the soak's ledger,
-- docs/quotas.md "What is given back").
local GCRA_WINDOW = 60000

-- The state at `key`, as of `now`: {tat, epoch, charged, stored}.
local function gcra_state(key, now)
  local raw = redis.call('GET', key)
  if not raw then return {tat = now, epoch = tostring(now), charged = 0, stored = false} end
  local tat, epoch, charged = string.match(raw, '^(%S+) (%d+) (%S+)$')
  if not tat then  -- written by a version without marks: a new state from here on, and
    -- what it charged before is unknown, so nothing is given back from it (legacy)
    return {tat = tonumber(raw) or now, epoch = tostring(now), charged = 0, stored = true, legacy = true}
  end
  return {tat = tonumber(tat), epoch = epoch, charged = tonumber(charged), stored = true}
end

local function gcra_write(key, state, now)
  redis.call('SET', key, string.format('%.17g %s %.17g', state.tat, state.epoch, state.charged),
    'PX', math.max(0, math.ceil(state.tat - now)) + GCRA_WINDOW)
end

-- Charge `cost` (already admitted or owed) to a state read at `now`; returns the mark.
local function gcra_charge(key, state, limit, cost, now)
  local charged = cost * (GCRA_WINDOW / limit)
  state.tat = math.max(state.tat, now) + charged
  state.charged = state.charged + charged
  gcra_write(key, state, now)
  return state.epoch .. ':' .. string.format('%.17g', state.charged)
end

-- Give back `cost` of the request whose mark is `mark` (never more than is provable:
-- above). A request without a mark (admitted by an earlier version) gets nothing back.
local function gcra_give_back(key, limit, cost, mark, now)
  if limit <= 0 or cost <= 0 then return end
  local state = gcra_state(key, now)
  if not state.stored or state.legacy or state.tat <= now then return end  -- in the past: nothing to give
  local epoch, at_mark = string.match(mark or '', '^(%d+):(%S+)$')
  if not epoch then return end
  -- Time charged since the request: all of this state's, if it came under an earlier one.
  local since = state.charged
  if epoch == state.epoch then since = state.charged - tonumber(at_mark) end
  local tat = math.max(state.tat - cost * (GCRA_WINDOW / limit), now + since)
  if tat < state.tat then
    state.tat = tat
    gcra_write(key, state, now)
  end
end
