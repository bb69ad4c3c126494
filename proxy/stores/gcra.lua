-- opgate GCRA rate limiter: one atomic decision over several buckets (all-or-nothing).
--
-- KEYS[i]      bucket key; its value is the theoretical arrival time (TAT) in microseconds.
-- ARGV[1]      "" in production (time comes from redis TIME); an explicit now (microseconds)
--              only in the table tests that compare this script with proxy/stores/base.py
--              (then keys get no expiry: the test clock is not the server's).
-- ARGV[2+4(i-1) ..] per key: interval_us, burst, cost, extra (extra = leased tokens wanted).
--
-- Returns {allowed, then per key: allowed, granted, remaining, retry_us, reset_us}.
-- Same arithmetic as proxy.stores.base.gcra_step. A key that is missing or whose TAT has passed
-- is a full bucket, so PEXPIRE at the TAT never changes an outcome. A TAT more than burst
-- intervals ahead (a debt run up at a lower qps: a reload, an instance's own qps raised) is an
-- empty bucket: it is cut to that depth and kept so even when the call is denied (nothing is
-- charged), as base.decide does.

if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

local now
local explicit = ARGV[1] ~= nil and ARGV[1] ~= ""
if explicit then
  now = tonumber(ARGV[1])
else
  local t = redis.call("TIME")
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local pending = {}
local cut = {}
local out = {1}
local allowed = 1
local n = #KEYS

for i = 1, n do
  local key = KEYS[i]
  local base = 2 + (i - 1) * 4
  local interval = tonumber(ARGV[base])
  local burst = tonumber(ARGV[base + 1])
  local cost = tonumber(ARGV[base + 2])
  local extra = tonumber(ARGV[base + 3])

  local fresh = pending[key] == nil
  local stored = pending[key]
  if fresh then
    stored = tonumber(redis.call("GET", key) or "0") or 0
  end
  local tat = stored
  if tat < now then
    tat = now
  end
  local limit = burst * interval
  if tat > now + limit then
    tat = now + limit
  end
  local new_tat = tat + cost * interval
  local allow_at = new_tat - limit
  local base_out = 2 + (i - 1) * 5
  if allow_at > now then
    local remaining = math.floor((now + limit - tat) / interval)
    if remaining < 0 then
      remaining = 0
    end
    allowed = 0
    if fresh and tat < stored then
      cut[key] = tat
    end
    out[base_out] = 0
    out[base_out + 1] = 0
    out[base_out + 2] = remaining
    out[base_out + 3] = allow_at - now
    out[base_out + 4] = tat - now
  else
    local left = math.floor((now - allow_at) / interval)
    local granted = math.floor(left / 2)
    if granted > extra then
      granted = extra
    end
    new_tat = new_tat + granted * interval
    pending[key] = new_tat
    out[base_out] = 1
    out[base_out + 1] = granted
    out[base_out + 2] = left - granted
    out[base_out + 3] = 0
    out[base_out + 4] = new_tat - now
  end
end

out[1] = allowed
local writes = pending
if allowed == 0 then
  writes = cut
end
for key, tat in pairs(writes) do
  local ttl = math.ceil((tat - now) / 1000)
  if ttl < 1 then
    ttl = 1
  end
  if explicit then
    -- test time runs apart from the server's clock, so a real expiry could come "early"
    redis.call("SET", key, string.format("%.0f", tat))
  else
    redis.call("SET", key, string.format("%.0f", tat), "PX", ttl)
  end
end
return out
