-- Reads an election's leader record (the Cluster backend sends its reads as scripts, routed by
-- the key's slot like its other calls).
-- KEYS[1]  the record key (`dlock:{<name>}:leader`)
-- Returns {epoch, value}, nil for a field that is not there.
return redis.call('HMGET', KEYS[1], 'epoch', 'value')
