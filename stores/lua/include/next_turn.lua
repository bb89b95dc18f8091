-- include/next_turn: a fragment, not a script. stores/scripts.py puts it in place of the line
-- "-- @include next_turn" of the scripts that hand the worker its next turn (lane_acquire,
-- turn_commit), so the two read it the same way. It builds no key names: the caller passes
-- its own KEYS.
--
-- count_attempt(state, entry, id, held): the entry's attempt count with this one, counted once
-- per ``id`` (the lane's fencing token for the attempt a lease starts with, a fresh nonce for each
-- retry): a call sent again after its reply was lost (a connection drop: redis-py re-sends the
-- command, or the whole pipeline) finds its own id and counts nothing. The field att:<entry>
-- holds "<count>|<id>" (a bare count is read as one counted by no id); ``held`` is that field as
-- the caller read it (false: none; nil: read here).
local function count_attempt(state, entry, id, held)
  local field = 'att:' .. entry
  if held == nil then
    held = redis.call('HGET', state, field)
  end
  local n, last = 0, nil
  if held then
    local count, by = string.match(held, '^(%d+)|(.*)$')
    if count then
      n, last = tonumber(count), by
    else
      n = tonumber(held) or 0
    end
  end
  if last == id then
    return n
  end
  n = n + 1
  redis.call('HSET', state, field, n .. '|' .. id)
  return n
end

-- next_turn(K, cursor, tier, context_turns, memory_k, token) where K holds the user's keys
--   K.state K.inbox K.session K.profile K.memory K.done
-- and ``token`` is the fencing token of the lane the caller holds (or takes).
-- Returns false when the inbox holds another type than a stream (read before any write: the
-- caller checks no type for it), {} when nothing follows the cursor, else {entry, fields,
-- context}: the first inbox
-- entry after the cursor, its fields as stored, and its context pack when the entry names a
-- turn id and is for ``tier``:
--   {session tail, profile (flat), top memories, 1 if the turn id was answered before else 0,
--    the attempt count with this one (count_attempt, once per lease), the turn id it was read for,
--    1 if the turn was cancelled (turn_cancel's record "cancel:<entry>" in the state hash) else 0}
-- or {} when it cannot tell (a binary entry written before the plain turn_id/tier fields, a
-- turn of another tier, or a context key of the wrong type: the worker then reads the pack
-- itself, and rejects the turn if it cannot, or hands the user over).
-- Needs include/key_types before it (try); the state is the caller's to check.
local function next_turn(K, cursor, tier, context_turns, memory_k, token)
  local start = '-'
  if cursor and cursor ~= '' then start = '(' .. cursor end
  local rows = try('XRANGE', K.inbox, start, '+', 'COUNT', 1)
  if rows == nil then
    return false
  end
  if #rows == 0 then
    return {}
  end
  local entry, fields = rows[1][1], rows[1][2]
  local binary, turn_id, entry_tier = false, false, false
  for i = 1, #fields - 1, 2 do
    local name = fields[i]
    if name == 'm' then
      binary = true
    elseif name == 'turn_id' then
      turn_id = fields[i + 1]
    elseif name == 'tier' then
      entry_tier = fields[i + 1]
    end
  end
  if not binary then  -- the plain form's defaults (README, "The raw protocol")
    turn_id = turn_id or entry
    entry_tier = entry_tier or tier
  end
  if not turn_id or entry_tier ~= tier then
    return {entry, fields, {}}
  end
  -- the context keys are only read here: each read checks its key's type (include/key_types)
  local done = try('ZSCORE', K.done, turn_id)
  local session = try('LRANGE', K.session, -context_turns, -1)
  local profile = try('HGETALL', K.profile)
  local memories = try('ZREVRANGE', K.memory, 0, memory_k - 1)
  if done == nil or session == nil or profile == nil or memories == nil then
    return {entry, fields, {}}
  end
  local marks = redis.call('HMGET', K.state, 'att:' .. entry, 'cancel:' .. entry)
  local context = {
    session,
    profile,
    memories,
    done and 1 or 0,
    count_attempt(K.state, entry, token, marks[1]),
    turn_id,
    marks[2] and 1 or 0,
  }
  return {entry, fields, context}
end
