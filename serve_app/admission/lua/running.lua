-- Mark an admitted request as running (its first token is out). Never moves a
-- settled request back. KEYS: 5 = the record (same KEYS as admit.lua).
-- ARGV: 1 replica that serves it ('' if unknown).
if redis.call('HGET', KEYS[5], 'status') ~= 'admitted' then return 0 end
local t = redis.call('TIME')
redis.call('HSET', KEYS[5], 'status', 'running',
  'first_token_ms', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
if ARGV[1] ~= '' then redis.call('HSET', KEYS[5], 'replica', ARGV[1]) end
return 1
