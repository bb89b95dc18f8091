-- stream_append: flushes of turns' streamed text to their reply streams (every stream a worker
-- flushes in one tick: on one node one call for all, on a Cluster one per call), each fenced:
-- written only while the caller holds the user's lane and the stream has not ended (the turn's
-- commit writes the 'end' entry: a flush that arrives after it, sent again after a dropped
-- connection, writes nothing). Flushes are the hot path of a streamed turn, so each reads two
-- keys, once each, with redis.pcall: a key of another type answers what it means, no TYPE
-- check. A flush's reads come before its one write, so it writes nothing unless 'ok'.
--
-- KEYS[1]  fleet:u:{U}:lane     must hold the flush's owner (fencing)
-- KEYS[2]  fleet:u:{U}:stream:<turn_id>  the turn's reply stream
-- ARGV[1]  "<worker>|<token>"   the owner
-- ARGV[2]  the attempt the text belongs to (an integer)
-- ARGV[3]  '1': write a 'restart' entry first (the first write of an attempt after the first,
--          or a resend of the attempt's whole text after a flush whose outcome is unknown); '0': none
-- ARGV[4]  the text ('' = none)
-- ARGV[5]  the stream's TTL in ms (the reply's), set by the stream's first write (the commit
--          sets it again)
-- ARGV[6]  the flush's id (unique per flush): a call sent again whole (a pipeline re-sent after
--          a dropped connection) finds its chunk already the stream's last entry and writes
--          nothing twice
-- and so on: flush i (from 0) is KEYS[2i+1..2i+2] and ARGV[6i+1..6i+6]. Several flushes span
-- users' slots: one node only (on a Cluster each call holds one flush).
--
-- Returns one answer per flush: 'ok' (written), 'fenced' (the lane is not the caller's),
-- 'done' (the stream has ended: the turn is answered) or 'wrongtype' (the stream key holds
-- another type). Arguments that do not fit fail the call before anything is written.
-- @include stream_write
if #KEYS == 0 or #KEYS % 2 ~= 0 or #ARGV ~= 3 * #KEYS then
  return redis.error_reply('BADARGS two keys and six arguments a flush')
end
for i = 0, #KEYS / 2 - 1 do
  if not tonumber(ARGV[6 * i + 2]) or not tonumber(ARGV[6 * i + 5]) then
    return redis.error_reply('BADARGS attempt and TTL must be numbers')
  end
end

local function flush(lane, stream, owner, attempt, restart, text, ttl_ms, id)
  if redis.pcall('GET', lane) ~= owner then  -- (a lane of another type is not the caller's)
    return 'fenced'
  end
  local tail = redis.pcall('XREVRANGE', stream, '+', '-', 'COUNT', 1)
  if tail.err then
    return 'wrongtype'
  end
  if tail[1] then
    local fields = tail[1][2]
    for i = 1, #fields - 1, 2 do
      if fields[i] == 'k' and fields[i + 1] == 'end' then
        return 'done'
      elseif fields[i] == 'f' and fields[i + 1] == id then
        return 'ok'
      end
    end
    ttl_ms = ''  -- (set by the first write)
  end
  stream_write(stream, attempt, restart, text, '', ttl_ms, id)
  return 'ok'
end

local out = {}
for i = 0, #KEYS / 2 - 1 do
  local a = 6 * i
  out[i + 1] = flush(KEYS[2 * i + 1], KEYS[2 * i + 2], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4],
                     ARGV[a + 5], ARGV[a + 6])
end
return out
