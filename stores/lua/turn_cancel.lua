-- turn_cancel: stop one of a user's turns. The cancel is a record in the user's state hash,
-- field "cancel:<entry>" (the turn's inbox entry id) = the time in ms, which the worker reads
-- with the turn (include/next_turn, and its own pull) and the commit checks atomically
-- (turn_commit: a turn with the record can only be committed as cancelled, and its commit
-- deletes the record). So a cancel and the turn's commit are ordered: whichever runs first
-- decides, and the turn gets exactly one reply.
--
-- KEYS[1]  fleet:u:{U}:state    "cursor", "att:<entry>", "cancel:<entry>"
-- KEYS[2]  fleet:u:{U}:inbox    the turns not yet answered are after the cursor
-- KEYS[3]  fleet:u:{U}:done     zset of answered turn ids
-- KEYS[4]  fleet:u:{U}:reply:<turn_id>  the reply, if nobody has read it yet
-- ARGV[1]  the turn id             ARGV[2]  now in ms
--
-- Returns
--   {'answered', reply}  the turn id was answered (the done-set): nothing written; ``reply`` is
--                        its reply as pushed (msgpack or JSON) if still unread, else ''
--   {'unknown'}          no entry after the cursor carries that turn id (a plain entry without
--                        a turn_id field is named by its entry id; one older binary entry with
--                        field m alone cannot be named)
--   {'cancelled', entry, first}  recorded (or recorded before: the same answer); ``first`` 1 if
--                        the entry is the first after the cursor, the one the lane's holder may
--                        be running now (the caller tells that worker), else 0
--   {'wrongtype', 0, wrong}  a key holds another type (include/key_types); nothing written
-- @include key_types
local wrong = wrong_types({{'state', KEYS[1], 'hash'}, {'inbox', KEYS[2], 'stream'},
                           {'done', KEYS[3], 'zset'}, {'reply', KEYS[4], 'list'}})
if #wrong > 0 then
  return {'wrongtype', 0, wrong}
end
if redis.call('ZSCORE', KEYS[3], ARGV[1]) then
  return {'answered', redis.call('LINDEX', KEYS[4], 0) or ''}
end
local cursor = redis.call('HGET', KEYS[1], 'cursor')
local start = '-'
if cursor then start = '(' .. cursor end
local first = true
while true do
  local rows = redis.call('XRANGE', KEYS[2], start, '+', 'COUNT', 100)
  if #rows == 0 then
    return {'unknown'}
  end
  for _, row in ipairs(rows) do
    local entry, fields, named = row[1], row[2], row[1]
    for i = 1, #fields, 2 do
      if fields[i] == 'turn_id' then named = fields[i + 1] end
    end
    if named == ARGV[1] then
      redis.call('HSETNX', KEYS[1], 'cancel:' .. entry, ARGV[2])
      return {'cancelled', entry, first and 1 or 0}
    end
    first = false
  end
  start = '(' .. rows[#rows][1]
end
