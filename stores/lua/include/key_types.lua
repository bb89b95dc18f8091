-- include/key_types: a fragment, not a script (see include/next_turn). Redis does not undo a
-- script that fails halfway: the writes before a failed command stay. So a script checks the
-- type of every key it is going to use before its first write, and a key that holds another
-- type (hostile or corrupt state) makes it answer with what it found, having written nothing.
--
-- wrong_types(checks), checks a list of {role, key, type}; a missing key ('none') fits any type.
-- Returns a flat list {role, key, found, wanted, ...} of the keys that do not fit ({} if all do).
local function wrong_types(checks)
  local out = {}
  for _, check in ipairs(checks) do
    local found = redis.call('TYPE', check[2])['ok']
    if found ~= 'none' and found ~= check[3] then
      out[#out + 1] = check[1]
      out[#out + 1] = check[2]
      out[#out + 1] = found
      out[#out + 1] = check[3]
    end
  end
  return out
end
