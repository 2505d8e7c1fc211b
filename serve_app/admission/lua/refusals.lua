-- An account's refusals per minute (admit.lua's and room.lua's: lua_scripts.py includes
-- it where a script says `--#include refusals`): one counter per minute and limit kind,
-- kept an hour; the minutes past it are dropped when a new minute's first refusal comes.
local function count_refusal(refusals, kind, now)
  local minute = math.floor(now / 60000)
  if redis.call('HINCRBY', refusals, minute .. ':' .. kind, 1) == 1 then
    for _, name in ipairs(redis.call('HKEYS', refusals)) do
      if tonumber(string.match(name, '^(%d+):')) < minute - 60 then redis.call('HDEL', refusals, name) end
    end
    redis.call('EXPIRE', refusals, 3660)
  end
end
