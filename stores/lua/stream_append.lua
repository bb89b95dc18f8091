-- stream_append: a flush of a turn's streamed text to its reply stream, fenced: written only
-- while the caller holds the user's lane and the turn is still the next one after the cursor
-- (not committed yet). A worker that lost the lane, or a flush that arrives after its turn's
-- commit (which closed the stream), writes nothing.
--
-- KEYS[1]  fleet:u:{U}:lane     must hold ARGV[1] (fencing)
-- KEYS[2]  fleet:u:{U}:state    "cursor"
-- KEYS[3]  fleet:u:{U}:inbox    the turn's entry must be the first after the cursor
-- KEYS[4]  fleet:u:{U}:stream:<turn_id>  the turn's reply stream
-- ARGV[1]  "<worker>|<token>"
-- ARGV[2]  inbox entry id of the turn
-- ARGV[3]  the attempt the text belongs to (an integer)
-- ARGV[4]  '1': write a 'restart' entry first (the first write of an attempt after the first,
--          or a resend of the attempt's whole text after a flush whose outcome is unknown); '0': none
-- ARGV[5]  the text ('' = none)
-- ARGV[6]  the stream's TTL in ms (the reply's)
-- ARGV[7]  the flush's id (unique per call the writer makes): a call sent again whole (a
--          pipeline re-sent after a dropped connection) finds its chunk already the stream's
--          last entry and writes nothing twice
--
-- Returns 'ok' (written), 'fenced' (the lane is not the caller's), 'done' (the turn is not the
-- next after the cursor: committed, or not the caller's to serve) or 'wrongtype' (KEYS[4]
-- holds another type); nothing is written unless 'ok'.
-- @include key_types
-- @include stream_write
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 'fenced'
end
if #wrong_types({{'state', KEYS[2], 'hash'}, {'inbox', KEYS[3], 'stream'}}) > 0 then
  return 'done'
end
if #wrong_types({{'stream', KEYS[4], 'stream'}}) > 0 then
  return 'wrongtype'
end
if not tonumber(ARGV[3]) or not tonumber(ARGV[6]) then
  return redis.error_reply('BADARGS attempt and TTL must be numbers')
end
local cursor = redis.call('HGET', KEYS[2], 'cursor')
local start = '-'
if cursor then start = '(' .. cursor end
local first = redis.call('XRANGE', KEYS[3], start, '+', 'COUNT', 1)
if #first == 0 or first[1][1] ~= ARGV[2] then
  return 'done'
end
local last = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)[1]
if last then
  local fields = last[2]
  for i = 1, #fields - 1, 2 do
    if fields[i] == 'f' and fields[i + 1] == ARGV[7] then
      return 'ok'
    end
  end
end
stream_write(KEYS[4], ARGV[3], ARGV[4], ARGV[5], '', ARGV[6], ARGV[7])
return 'ok'
