-- turn_submit: submit turns on a single Redis node in one call: for each turn, its entry on
-- the user's inbox, then its notification on the user's ready shard of the tier; then the
-- users in the tier's active set. Atomic: no other command runs in between, so a turn can
-- never sit in an inbox without its notification, nor a notification precede its turn.
--
-- SINGLE NODE ONLY: the user's inbox and the tier's keys are in different hash slots, which
-- a Redis Cluster refuses in one script. There the client submits in two ordered round trips
-- instead (stores/submit.py, submit_ordered). tests/unit/test_slots.py lists this script as
-- a single-node exception.
--
-- KEYS[1]  fleet:{T}:active     zset user -> last submit time (the tier's active users)
-- KEYS[2 .. 1+N]      fleet:u:{U}:inbox   the inbox of the user of turn i (i = 1 .. N)
-- KEYS[2+N .. 1+2N]   fleet:{T}:ready     the ready shard of the user of turn i
-- ARGV[1]  N: the number of turns
-- ARGV[2 ..] per turn 5 values: user, submit time (seconds), turn id, tier, payload (msgpack
--          Turn); the entry is written as fields m (payload), turn_id and tier: the plain
--          fields let the scripts that read the inbox see the turn id and tier without
--          decoding msgpack (include/next_turn.lua)
-- ARGV[last] optional, after the turns: the tier's retention in ms (an integer); > 0: each
--          inbox written expires that long after this submit
--
-- Returns the inbox entry ids, in order. A write that fails while the script runs (a key of the
-- wrong type, out of memory) leaves the writes before it, as a failing command inside EXEC did
-- (the ones after it are not made: the script stops there).
local n = tonumber(ARGV[1])
if not n or #KEYS ~= 1 + 2 * n or (#ARGV ~= 1 + 5 * n and #ARGV ~= 2 + 5 * n) then
  return redis.error_reply('BADARGS turn count does not match the keys and arguments')
end
-- A script is not rolled back: a write the caller's ACL refuses would fail halfway, after the
-- writes before it. So every write is checked first (Redis >= 7: redis.acl_check_cmd), and a
-- refused one refuses the whole submit, as a command refused inside MULTI discards it.
if redis.acl_check_cmd then
  local checks = {{'ZADD', KEYS[1], '0', 'u'}}
  for i = 1, n do
    checks[#checks + 1] = {'XADD', KEYS[1 + i], '*', 'm', 'x'}
    checks[#checks + 1] = {'XADD', KEYS[1 + n + i], '*', 'user', 'u'}
    if #ARGV == 2 + 5 * n then checks[#checks + 1] = {'PEXPIRE', KEYS[1 + i], '1'} end
  end
  for _, c in ipairs(checks) do
    if not redis.acl_check_cmd((table.unpack or unpack)(c)) then
      return redis.error_reply("NOPERM this user has no permissions to run the '" .. string.lower(c[1]) ..
                               "' command on " .. c[2])
    end
  end
end
local ids = {}
for i = 1, n do
  local at = 2 + 5 * (i - 1)
  ids[i] = redis.call('XADD', KEYS[1 + i], '*', 'm', ARGV[at + 4], 'turn_id', ARGV[at + 2],
                      'tier', ARGV[at + 3])
  redis.call('XADD', KEYS[1 + n + i], '*', 'user', ARGV[at])
end
for i = 1, n do
  local at = 2 + 5 * (i - 1)
  redis.call('ZADD', KEYS[1], ARGV[at + 1], ARGV[at])
end

-- retention: each inbox expires ARGV[2 + 5n] ms after its last submit (a commit sets it again)
if (tonumber(ARGV[2 + 5 * n] or '0') or 0) > 0 then
  for i = 1, n do redis.call('PEXPIRE', KEYS[1 + i], ARGV[2 + 5 * n]) end
end
return ids
