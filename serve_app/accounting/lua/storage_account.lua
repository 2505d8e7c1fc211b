-- One API key's stored objects of one kind (its files on disk; its stored
-- responses in Redis): the bytes of each object (a hash, plus the field 'total')
-- and when each stops counting (a sorted set by expiry, ms). One call, atomic:
-- entries past their expiry are forgotten first (at most 1,000 a call: the rest
-- on the next), then
--   reserve: room for a new object of ARGV[3] bytes, if the key stays within
--            ARGV[6] bytes and ARGV[7] objects; else nothing changes;
--   grow:    ARGV[3] bytes more for an object (made if new: a batch's results, as
--            each line is written), if the key stays within ARGV[6] bytes and
--            ARGV[7] objects; else nothing changes;
--   record:  an object's bytes and expiry, unchecked (an upload's real size after
--            its reservation; a batch's results once whole, already grown);
--   release: the object no longer counts (deleted, or never made);
--   read:    nothing changes (the key's use).
-- KEYS: space hash, expiry zset.
-- ARGV: op, file id, bytes, expires at ms, now ms, max bytes, max files, keys' ttl ms.
-- Returns {done 0|1, total bytes, files} (after the call).
local space, expiry = KEYS[1], KEYS[2]
local op, id = ARGV[1], ARGV[2]
local bytes, expires, now = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local max_bytes, max_files, ttl = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])

local function forget(file)
  local held = redis.call('HGET', space, file)
  if held then
    redis.call('HINCRBY', space, 'total', -tonumber(held))
    redis.call('HDEL', space, file)
  end
  redis.call('ZREM', expiry, file)
end

for _, file in ipairs(redis.call('ZRANGEBYSCORE', expiry, '-inf', now, 'LIMIT', 0, 1000)) do
  forget(file)
end

if op == 'release' then
  forget(id)
end
local total = tonumber(redis.call('HGET', space, 'total') or '0')
local files = redis.call('HLEN', space) - redis.call('HEXISTS', space, 'total')
if op == 'release' or op == 'read' then
  return {1, total, files}
end

local held = redis.call('HGET', space, id)
if op == 'reserve' and (held or files >= max_files or total + bytes > max_bytes) then
  return {0, total, files}
end
if op == 'grow' then
  if (not held and files >= max_files) or total + bytes > max_bytes then return {0, total, files} end
  bytes = bytes + tonumber(held or '0')
end
if not held then
  files = files + 1
end
total = total + bytes - tonumber(held or '0')
redis.call('HSET', space, id, bytes)
redis.call('HSET', space, 'total', total)
redis.call('ZADD', expiry, expires, id)
redis.call('PEXPIRE', space, ttl)
redis.call('PEXPIRE', expiry, ttl)
return {1, total, files}
