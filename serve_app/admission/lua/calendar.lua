-- The UTC calendar of a Redis TIME in ms, shared by admit.lua and room.lua
-- (lua_scripts.py includes it where a script says `--#include calendar`): the usage
-- counters' day and month fields, and when the next day and month start.

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
