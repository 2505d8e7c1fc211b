-- Renew the concurrency leases of one key's requests that one ingress is still
-- serving (it calls this every third of the lease period for all of them, in
-- one pipeline). A request already settled or reaped is not brought back.
--
-- KEYS: 1 the key's leases (zset), 2.. the records of the requests
-- ARGV: 1 lease ms, 2.. the request ids (ARGV[i] is the id of KEYS[i])
-- Returns how many leases were renewed.
local WINDOW = 60000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease_ms = tonumber(ARGV[1])
local renewed = 0
for i = 2, #KEYS do
  local status = redis.call('HGET', KEYS[i], 'status')
  if status == 'admitted' or status == 'running' then
    redis.call('ZADD', KEYS[1], now + lease_ms, ARGV[i])
    renewed = renewed + 1
  end
end
if renewed > 0 then redis.call('PEXPIRE', KEYS[1], lease_ms + WINDOW) end
return renewed
