-- include/stream_write: a fragment, not a script (see include/next_turn). Appends to a turn's
-- reply stream (keys.stream: fleet:u:{U}:stream:<turn_id>), for stream_append (a flush of
-- streamed text while the handler runs) and turn_commit (the rest of it, and the end).
--
-- stream_write(key, attempt, restart, text, status, ttl_ms, flush): in this order, each only if
-- asked,
--   'k' 'restart' 'a' <attempt>      restart == '1': the reader drops the text it holds
--   'k' 'chunk' 'a' <attempt> 't' <text> ['f' <flush>]   text ~= '': the next piece of the
--                                    attempt's text (a flush's, named by its id: see stream_append)
--   'k' 'end' 'status' <status>      status ~= '': the turn is answered (closes the stream)
-- then, unless ttl_ms is '', the stream expires ttl_ms from now, as the reply list does. The
-- caller has checked the key's type (a stream, or none).
local function stream_write(key, attempt, restart, text, status, ttl_ms, flush)
  if restart == '1' then
    redis.call('XADD', key, '*', 'k', 'restart', 'a', attempt)
  end
  if text ~= '' and flush then
    redis.call('XADD', key, '*', 'k', 'chunk', 'a', attempt, 't', text, 'f', flush)
  elseif text ~= '' then
    redis.call('XADD', key, '*', 'k', 'chunk', 'a', attempt, 't', text)
  end
  if status ~= '' then
    redis.call('XADD', key, '*', 'k', 'end', 'status', status)
  end
  if ttl_ms ~= '' and (restart == '1' or text ~= '' or status ~= '') then
    redis.call('PEXPIRE', key, ttl_ms)
  end
end
