-- turn_commit: the atomic write-back of one turn, fenced and idempotent.
-- Advances the user's cursor past the turn's inbox entry together with every write the
-- turn makes, so a turn re-run after a crash can never be written twice.
--
-- KEYS[1]  fleet:u:{U}:lane     must hold ARGV[1] (fencing)
-- KEYS[2]  fleet:u:{U}:state    "cursor", "att:<entry>"
-- KEYS[3]  fleet:u:{U}:inbox    the entry is deleted once done
-- KEYS[4]  fleet:u:{U}:session  list of msgpack SessionEntry
-- KEYS[5]  fleet:u:{U}:done     zset of answered turn ids (score = now ms)
-- KEYS[6]  fleet:u:{U}:reply:<turn_id>  list the submitter BLPOPs
-- KEYS[7]  fleet:u:{U}:usage    hash of consumption counters
-- KEYS[8]  fleet:u:{U}:profile  hash
-- KEYS[9]  fleet:u:{U}:memory   zset of msgpack MemoryItem by score
-- ARGV[1]  "<worker>|<token>"
-- ARGV[2]  inbox entry id of the turn: must be the first entry after the cursor
-- ARGV[3]  turn id to remember as answered ('' = none)
-- ARGV[4]  session entry ('' = none)        ARGV[5]  session max length
-- ARGV[6]  reply payload ('' = no reply)    ARGV[7]  reply TTL in ms
-- ARGV[8]  how many answered turn ids to remember
-- ARGV[9]  now in ms
-- ARGV[10] memory max size (lowest scores are dropped)
-- ARGV[11] P: number of profile (field, value) pairs that follow
-- ARGV[12] M: number of memory (member, score) pairs that follow
-- ARGV[13] Q: number of usage (counter, increment) pairs that follow
-- ARGV[14 ..] the P profile pairs, then the M memory pairs, then the Q usage pairs
--
-- Returns 'ok'; 'stale' if the entry is not the next one after the cursor (already done);
-- 'dup' if the turn id was answered before (a resubmitted turn): the cursor moves past the
-- entry and nothing else is written, so a turn gets exactly one reply however often it was
-- submitted; an error 'FENCED ...' if the caller no longer holds the lane.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED lane lost')
end
local cursor = redis.call('HGET', KEYS[2], 'cursor')
local start = '-'
if cursor then start = '(' .. cursor end
local nxt = redis.call('XRANGE', KEYS[3], start, '+', 'COUNT', 1)
if #nxt == 0 or nxt[1][1] ~= ARGV[2] then
  return 'stale'
end

if ARGV[3] ~= '' and redis.call('ZSCORE', KEYS[5], ARGV[3]) then
  redis.call('HSET', KEYS[2], 'cursor', ARGV[2])
  redis.call('HDEL', KEYS[2], 'att:' .. ARGV[2])
  redis.call('XDEL', KEYS[3], ARGV[2])
  return 'dup'
end

-- check every argument before the first write: a script that fails halfway is not undone
local np, nm, nu = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
if not (np and nm and nu) or #ARGV ~= 13 + 2 * (np + nm + nu) then
  return redis.error_reply('BADARGS pair counts do not match the arguments')
end
local first_mem, first_use = 14 + 2 * np, 14 + 2 * (np + nm)
for i = first_mem, first_mem + 2 * nm - 1, 2 do
  if not tonumber(ARGV[i + 1]) then return redis.error_reply('BADARGS memory score') end
end
for i = first_use, first_use + 2 * nu - 1, 2 do
  if not tonumber(ARGV[i + 1]) then return redis.error_reply('BADARGS usage increment') end
end

redis.call('HSET', KEYS[2], 'cursor', ARGV[2])
redis.call('HDEL', KEYS[2], 'att:' .. ARGV[2])
redis.call('XDEL', KEYS[3], ARGV[2])

if ARGV[3] ~= '' then
  redis.call('ZADD', KEYS[5], ARGV[9], ARGV[3])
  redis.call('ZREMRANGEBYRANK', KEYS[5], 0, -(tonumber(ARGV[8]) + 1))
end
if ARGV[4] ~= '' then
  redis.call('RPUSH', KEYS[4], ARGV[4])
  redis.call('LTRIM', KEYS[4], -tonumber(ARGV[5]), -1)
end
if ARGV[6] ~= '' then
  redis.call('RPUSH', KEYS[6], ARGV[6])
  redis.call('PEXPIRE', KEYS[6], ARGV[7])
end
for i = 14, first_mem - 1, 2 do
  redis.call('HSET', KEYS[8], ARGV[i], ARGV[i + 1])
end
if nm > 0 then
  for i = first_mem, first_use - 1, 2 do
    redis.call('ZADD', KEYS[9], ARGV[i + 1], ARGV[i])
  end
  redis.call('ZREMRANGEBYRANK', KEYS[9], 0, -(tonumber(ARGV[10]) + 1))
end
for i = first_use, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[7], ARGV[i], ARGV[i + 1])
end
return 'ok'
