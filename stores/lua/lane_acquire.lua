-- lane_acquire: take a user's lane (lease) if it is free and a turn waits, with a new fencing
-- token, and hand back the first turn after the cursor with its context pack (one round trip
-- for the lane, the turn, the session, the profile, the memories, the duplicate check and
-- the attempt count: counted once per lease, so an acquire sent again after a lost reply, which
-- finds the lane its own, counts nothing more).
--
-- KEYS[1]  fleet:u:{U}:lane     string "<worker>|<token>" with a PX TTL
-- KEYS[2]  fleet:u:{U}:fence    counter of fencing tokens
-- KEYS[3]  fleet:u:{U}:state    hash; "cursor" = last inbox id done, "att:<entry>" attempts
-- KEYS[4]  fleet:u:{U}:inbox    stream of the user's turns
-- KEYS[5]  fleet:u:{U}:session  list of msgpack SessionEntry (the tail is the context)
-- KEYS[6]  fleet:u:{U}:profile  hash
-- KEYS[7]  fleet:u:{U}:memory   zset of msgpack MemoryItem
-- KEYS[8]  fleet:u:{U}:done     zset of answered turn ids
-- ARGV[1]  worker id
-- ARGV[2]  lease TTL in milliseconds
-- ARGV[3]  the worker's tier (a turn of another tier gets no context: it is handed over)
-- ARGV[4]  session entries in the context pack
-- ARGV[5]  memories in the context pack
--
-- Returns {1, token, cursor, next}  the caller holds the lane (new, or its own): next is the
--                                   first turn after the cursor, as include/next_turn says;
--         {0, holder, pttl}         another worker holds it;
--         {2}                       the lane was free (or the caller's own) and nothing waits
--                                   after the cursor: it is left free (the caller's own is
--                                   deleted), as if taken, found empty and released at once.
-- An error 'WRONGTYPE <key> holds a <type>, not a <type>' if the lane, the fence, the state or
-- the inbox holds another type, 'BADLANE' if the lane holds no "<worker>|<token>", or 'BADFENCE'
-- if the fence is no integer: nothing written.
local K = {state = KEYS[3], inbox = KEYS[4], session = KEYS[5], profile = KEYS[6],
           memory = KEYS[7], done = KEYS[8]}
-- @include key_types
-- @include next_turn

local function wrong_type(wrong)
  return redis.error_reply('WRONGTYPE ' .. wrong[2] .. ' holds a ' .. wrong[3] .. ', not a ' .. wrong[4])
end

-- the lane, the fence and the state are read before any write, and the inbox by next_turn
-- before its first: each read checks its key's type (try), and the first of another type is
-- named
local held, fence = try('GET', KEYS[1]), try('GET', KEYS[2])
local cursor = try('HGET', KEYS[3], 'cursor')
if held == nil or fence == nil or cursor == nil then
  return wrong_type(wrong_types({{'lane', KEYS[1], 'string'}, {'fence', KEYS[2], 'string'},
                                 {'state', KEYS[3], 'hash'}}))
end
local token
if held then
  local owner, current = string.match(held, '^(.*)|(%d+)$')
  if not owner then  -- no worker's: nobody would ever release it
    return redis.error_reply('BADLANE ' .. KEYS[1] .. ' holds no "<worker>|<token>"')
  end
  if owner ~= ARGV[1] then
    return {0, held, redis.call('PTTL', KEYS[1])}
  end
  token = current
else  -- INCR fails on a fence that is no integer: known before the first write
  if fence and not string.match(fence, '^%d+$') then
    return redis.error_reply('BADFENCE ' .. KEYS[2] .. ' holds no integer')
  end
  -- the token the lane gets if a turn waits (the INCR below): it counts the attempt
  token = tostring((tonumber(fence) or 0) + 1)
end
local nxt = next_turn(K, cursor, ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), token)
if nxt == false then
  return wrong_type(wrong_types({{'inbox', KEYS[4], 'stream'}}))
end
if #nxt == 0 then
  if held then redis.call('DEL', KEYS[1]) end
  return {2}
end
if held then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1] .. '|' .. redis.call('INCR', KEYS[2]), 'PX', ARGV[2])
end
return {1, token, cursor or '', nxt}
