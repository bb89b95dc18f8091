-- turn_commit: the atomic write-back of one turn, fenced and idempotent, then the lane: given
-- up if nothing waits after the new cursor, else kept, with the next turn and its context
-- pack handed back (a visit of several turns is one round trip per turn).
-- Advances the user's cursor past the turn's inbox entry together with every write the
-- turn makes, so a turn re-run after a crash can never be written twice.
--
-- KEYS[1]  fleet:u:{U}:lane     must hold ARGV[1] (fencing)
-- KEYS[2]  fleet:u:{U}:state    "cursor", "att:<entry>", "cancel:<entry>" (turn_cancel's record)
-- KEYS[3]  fleet:u:{U}:inbox    the entry is deleted once done
-- KEYS[4]  fleet:u:{U}:session  list of msgpack SessionEntry
-- KEYS[5]  fleet:u:{U}:done     zset of answered turn ids (score = now ms)
-- KEYS[6]  fleet:u:{U}:reply:<turn_id>  list the submitter BLPOPs
-- KEYS[7]  fleet:u:{U}:usage    hash of consumption counters
-- KEYS[8]  fleet:u:{U}:profile  hash
-- KEYS[9]  fleet:u:{U}:memory   zset of msgpack MemoryItem by score
-- KEYS[10] fleet:u:{U}:outbox   stream of deferred jobs (fields job, d) the relay moves to RQ
-- KEYS[11] fleet:u:{U}:fence    (retention only)
-- KEYS[12] fleet:u:{U}:pins     (retention only)
-- KEYS[13] fleet:u:{U}:stream:<turn_id>  optional: the turn's reply stream (a streamed turn)
-- ARGV[1]  "<worker>|<token>"
-- ARGV[2]  inbox entry id of the turn: must be the first entry after the cursor
-- ARGV[3]  turn id to remember as answered ('' = none)
-- ARGV[4]  session entry ('' = none)        ARGV[5]  session max length
-- ARGV[6]  reply payload ('' = no reply)    ARGV[7]  reply TTL in ms
-- ARGV[8]  how many answered turn ids to remember
-- ARGV[9]  now in ms
-- ARGV[10] memory max size (lowest scores are dropped)
-- ARGV[11] the worker's tier                ARGV[12] session entries in the next context pack
-- ARGV[13] memories in the next context pack
-- ARGV[14] P: number of profile (field, value) pairs that follow
-- ARGV[15] M: number of memory (member, score) pairs that follow
-- ARGV[16] Q: number of usage (counter, increment) pairs that follow
-- ARGV[17] D: number of deferral (job id, msgpack Deferral) pairs that follow
-- ARGV[18 ..] the P profile pairs, then the M memory pairs, then the Q usage pairs, then the
--          D deferral pairs (each one XADDed to the outbox: written with the turn or not at all)
-- ARGV[last] optional, after the pairs: the retention in ms (an integer); > 0: every key of the user but the
--          lane and the reply expires that long after this commit; 0: none expires (an expiry
--          an earlier commit set is removed)
-- ARGV[last + 1] optional, after the retention: how the turn ended ('ok', 'error', 'expired',
--          'cancelled'; absent: 'ok'). A turn its user cancelled (turn_cancel's record) is
--          committed only as 'cancelled': any other answer is refused (below).
-- ARGV[last+2 .. last+4] optional, after the status (with KEYS[13]): a streamed turn's tail,
--          written to its reply stream with the reply (include/stream_write): the attempt, '1' to
--          write a 'restart' entry first (else '0') and the text not flushed yet ('' = none); the
--          'end' entry that closes the stream carries the status
--
-- Returns {result, released, next}:
--   result  'ok'; 'stale' if the entry is not the next one after the cursor (already done:
--           nothing written); 'dup' if the turn id was answered before (a resubmitted turn):
--           the cursor moves past the entry and nothing else is written, so a turn gets
--           exactly one reply (and its deferrals one outbox entry each) however often it was
--           submitted; 'cancelled' if the turn was cancelled and these writes are not its
--           cancelled answer: nothing written, the lane kept ({'cancelled', 0, {}}): the caller
--           commits the turn's cancelled reply instead;
--   released 1 if nothing waits after the cursor (as Redis has it): the lane is deleted; else 0
--           and the lane is kept;
--   next    {} when released, else the first turn after the cursor with its context, as
--           include/next_turn says (after a commit a failover lost, that is the lost turn
--           again: the worker serves on from Redis's cursor, never from its own).
-- Or {'wrongtype', 0, {}, wrong}: a key the commit needs holds another type, as
-- include/key_types lists them (role, key, found, wanted); nothing written, the lane kept.
-- An error 'FENCED ...' if the caller no longer holds the lane (nothing written).
--
-- Every key is checked and every argument validated before the first write: Redis does not
-- undo a script that fails halfway, and a turn is consumed only together with its answer.
local K = {state = KEYS[2], inbox = KEYS[3], session = KEYS[4], profile = KEYS[8],
           memory = KEYS[9], done = KEYS[5]}
-- @include key_types
-- @include next_turn
-- @include stream_write

local function finish(result, cursor)
  local token = string.match(ARGV[1], '|(%d+)$')
  local nxt = next_turn(K, cursor, ARGV[11], tonumber(ARGV[12]), tonumber(ARGV[13]), token)
  if not nxt or #nxt == 0 then  -- (false: an inbox of another type, which the first read rules out)
    redis.call('DEL', KEYS[1])
    return {result, 1, {}}
  end
  return {result, 0, nxt}
end

if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED lane lost')
end
-- the state (its cursor and the turn's cancel mark), the inbox and the answered ids are read
-- before any write: their reads check their types (include/key_types), and a key of another type
-- is named with every other one
local checks = {{'state', KEYS[2], 'hash'}, {'inbox', KEYS[3], 'stream'}}
if ARGV[3] ~= '' then checks[#checks + 1] = {'done', KEYS[5], 'zset'} end
local marks = try('HMGET', KEYS[2], 'cursor', 'cancel:' .. ARGV[2])
local cursor, cancelled = marks and marks[1], marks and marks[2]
local start = '-'
if cursor then start = '(' .. cursor end
local first = try('XRANGE', KEYS[3], start, '+', 'COUNT', 1)
local answered = false
if ARGV[3] ~= '' then answered = try('ZSCORE', KEYS[5], ARGV[3]) end
if cursor == nil or first == nil or answered == nil then
  return {'wrongtype', 0, {}, wrong_types(checks)}
end
if #first == 0 or first[1][1] ~= ARGV[2] then
  return finish('stale', cursor)
end

if answered then
  redis.call('HSET', KEYS[2], 'cursor', ARGV[2])
  redis.call('HDEL', KEYS[2], 'att:' .. ARGV[2], 'cancel:' .. ARGV[2])
  redis.call('XDEL', KEYS[3], ARGV[2])
  return finish('dup', ARGV[2])
end

-- every argument, then every key it writes, checked before the first write
local np, nm, nu, nd = tonumber(ARGV[14]), tonumber(ARGV[15]), tonumber(ARGV[16]), tonumber(ARGV[17])
local pairs_end = 17 + 2 * ((np or 0) + (nm or 0) + (nu or 0) + (nd or 0))
local streamed = #ARGV == pairs_end + 5
if not (np and nm and nu and nd) or (#ARGV < pairs_end or #ARGV > pairs_end + 2) and not streamed then
  return redis.error_reply('BADARGS pair counts do not match the arguments')
end
local status = ARGV[pairs_end + 2] or 'ok'
if streamed and (#KEYS < 13 or not tonumber(ARGV[pairs_end + 3])) then
  return redis.error_reply('BADARGS a streamed tail needs its stream key and an attempt')
end
if status ~= 'cancelled' and cancelled then
  return {'cancelled', 0, {}}
end
local first_mem, first_use = 18 + 2 * np, 18 + 2 * (np + nm)
local first_def = 18 + 2 * (np + nm + nu)
for i = first_mem, first_mem + 2 * nm - 1, 2 do
  if not tonumber(ARGV[i + 1]) then return redis.error_reply('BADARGS memory score') end
end
for i = first_use, first_use + 2 * nu - 1, 2 do
  if not tonumber(ARGV[i + 1]) then return redis.error_reply('BADARGS usage increment') end
end
-- (the reply's key is checked by its own write, the first: below)
checks = {}
if ARGV[4] ~= '' then checks[#checks + 1] = {'session', KEYS[4], 'list'} end
if np > 0 then checks[#checks + 1] = {'profile', KEYS[8], 'hash'} end
if nm > 0 then checks[#checks + 1] = {'memory', KEYS[9], 'zset'} end
if nu > 0 then checks[#checks + 1] = {'usage', KEYS[7], 'hash'} end
if nd > 0 then checks[#checks + 1] = {'outbox', KEYS[10], 'stream'} end
if streamed then checks[#checks + 1] = {'stream', KEYS[13], 'stream'} end
local wrong = wrong_types(checks)
if #wrong > 0 then
  return {'wrongtype', 0, {}, wrong}
end

if ARGV[6] ~= '' then
  if try('RPUSH', KEYS[6], ARGV[6]) == nil then  -- nothing written yet
    return {'wrongtype', 0, {}, wrong_types({{'reply', KEYS[6], 'list'}})}
  end
  redis.call('PEXPIRE', KEYS[6], ARGV[7])
end
redis.call('HSET', KEYS[2], 'cursor', ARGV[2])
redis.call('HDEL', KEYS[2], 'att:' .. ARGV[2], 'cancel:' .. ARGV[2])
redis.call('XDEL', KEYS[3], ARGV[2])

-- The session is cut back to its bound only once a push takes it past (RPUSH says its length):
-- a user below the bound costs no LTRIM. The answered ids and the memories are trimmed with
-- it (a full session: every turn), and the answered ids at once by a turn with no session
-- entry (an error); below that they grow by a turn's own writes only, so each stays bounded.
local session_max = tonumber(ARGV[5])
local trim = ARGV[4] == ''
if ARGV[4] ~= '' then
  if redis.call('RPUSH', KEYS[4], ARGV[4]) > session_max then
    redis.call('LTRIM', KEYS[4], -session_max, -1)
    trim = true
  end
end
if ARGV[3] ~= '' then
  redis.call('ZADD', KEYS[5], ARGV[9], ARGV[3])
  if trim then redis.call('ZREMRANGEBYRANK', KEYS[5], 0, -(tonumber(ARGV[8]) + 1)) end
end
if streamed then  -- after the reply: a reader that sees 'end' finds the reply there
  stream_write(KEYS[13], ARGV[pairs_end + 3], ARGV[pairs_end + 4], ARGV[pairs_end + 5], status,
               ARGV[7])
end
for i = 18, first_mem - 1, 2 do
  redis.call('HSET', KEYS[8], ARGV[i], ARGV[i + 1])
end
if nm > 0 then
  for i = first_mem, first_use - 1, 2 do
    redis.call('ZADD', KEYS[9], ARGV[i + 1], ARGV[i])
  end
  if trim or nm > 1 then redis.call('ZREMRANGEBYRANK', KEYS[9], 0, -(tonumber(ARGV[10]) + 1)) end
end
for i = first_use, first_def - 1, 2 do
  redis.call('HINCRBY', KEYS[7], ARGV[i], ARGV[i + 1])
end
for i = first_def, pairs_end, 2 do
  redis.call('XADD', KEYS[10], '*', 'job', ARGV[i], 'd', ARGV[i + 1])
end

-- retention: the user's keys expire ARGV[pairs_end + 1] ms after the user's last commit
local retention = tonumber(ARGV[pairs_end + 1] or '0') or 0
local kept = {KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12]}
if retention > 0 then
  for _, key in ipairs(kept) do redis.call('PEXPIRE', key, ARGV[pairs_end + 1]) end
elseif #KEYS >= 12 and redis.call('PTTL', KEYS[2]) >= 0 then  -- retention turned off: keep them
  for _, key in ipairs(kept) do redis.call('PERSIST', key) end
end
return finish('ok', ARGV[2])
