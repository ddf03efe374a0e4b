#!/usr/bin/env python3
"""Server instructions per acquire+release pair, counted by callgrind (issue 7, deliverable 5).

Wall-clock CPU figures on a shared box move by tens of percent between runs; instruction counts
do not (repeat runs agree within about 1 %). This runs one private `redis-server` under
`valgrind --tool=callgrind` (`--hz 1`, no persistence, a free loopback port), pipes N pairs of
each variant through `redis-cli --pipe` (EVALSHA of the scripts, no client logic), and divides
the instructions the server executed during those N pairs (counters zeroed and dumped with
`callgrind_control` around each batch, after a warm-up batch) by N. The count includes the
server's network reads and writes of both commands, as `used_cpu_user+sys` does.

Usage: python3 benches/server_instr.py [pairs] [git-rev ...]
  pairs    default 4000 (valgrind runs the server ~50x slower; 4000 pairs take ~10 s a variant)
  git-rev  also measure dlock's scripts as of these revisions (e.g. 49fb07a), read by `git show`
Variants: dlock (the working tree's acquire.lua + release.lua, outermost release, a free key;
`+queue`: the release names the waiters' queue key, as the client sends it since issue 19's
queue, for scripts that have one),
the minimal re-entrant pair of benches/server_cpu.py (hash + PEXPIRE, then DEL + PUBLISH, no
fencing), rslock (SET NX PX + its unlock script), dlock's semaphore permit pair and read-write
read and write pairs (issue 21), and two reference shapes (bench-written scripts with the command
sequence of Redisson's expirable semaphore and first read lock). Two rounds; the second is printed.
"""
import glob, os, socket, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, '..')
SCRIPTS = 'dlock-runtime/src/scripts'
N = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
REVS = sys.argv[2:]

# The variants' scripts and the RESP helpers are server_cpu.py's (same directory).
sys.path.insert(0, HERE)
from server_cpu import MIN_ACQ, MIN_REL, RSL_REL, free_port, resp  # noqa: E402


def script(rev, name):
    if rev is None:
        return open(os.path.join(ROOT, SCRIPTS, name)).read()
    return subprocess.run(['git', '-C', ROOT, 'show', f'{rev}:{SCRIPTS}/{name}'],
                          capture_output=True, check=True).stdout.decode()


def main():
    port = free_port(); d = tempfile.mkdtemp(); out = os.path.join(d, 'callgrind.out')
    srv = subprocess.Popen(['valgrind', '--tool=callgrind', '--callgrind-out-file=' + out,
                            'redis-server', '--port', str(port), '--bind', '127.0.0.1', '--save', '',
                            '--appendonly', 'no', '--dir', d, '--hz', '1'],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cli = ['redis-cli', '-p', str(port)]
    def q(*a): return subprocess.run(cli + list(a), capture_output=True, check=True).stdout.decode()
    def ctl(flag): subprocess.run(['callgrind_control', flag, str(srv.pid)], capture_output=True, check=True)
    try:
        for _ in range(600):
            if subprocess.run(cli + ['PING'], capture_output=True).stdout.strip() == b'PONG':
                break
            time.sleep(0.1)
        load = lambda src: q('SCRIPT', 'LOAD', src).strip()
        owner = 'o:0123456789abcdef:1'
        variants = []
        for rev in [None] + REVS:
            acq, rel = load(script(rev, 'acquire.lua')), load(script(rev, 'release.lua'))
            variants.append((f'dlock {rev or "(tree)"}',
                             resp('EVALSHA', acq, 2, 'dlock:{k}', 'dlock:{k}:fence', owner, 30000, 90000)
                             + resp('EVALSHA', rel, 1, 'dlock:{k}', owner, 0, 'dlock:{k}:rel', 1)))
            if 'ZPOPMIN' in script(rev, 'release.lua'):
                # As the client sends it since the waiters' queue: the release names the queue
                # key (empty here: nobody waits), so it checks it before publishing.
                variants.append((f'dlock {rev or "(tree)"} +queue',
                                 resp('EVALSHA', acq, 2, 'dlock:{k}', 'dlock:{k}:fence', owner, 30000, 90000)
                                 + resp('EVALSHA', rel, 2, 'dlock:{k}', 'dlock:{k}:q', owner, 0,
                                        'dlock:{k}:rel', 1)))
        macq, mrel, rrel = load(MIN_ACQ), load(MIN_REL), load(RSL_REL)
        variants.append(('minimal re-entrant', resp('EVALSHA', macq, 1, 'min:{k}', owner, 30000)
                         + resp('EVALSHA', mrel, 1, 'min:{k}', owner, 30000, 'min:{k}:rel')))
        variants.append(('rslock', resp('SET', 'rsl:k', owner, 'NX', 'PX', 30000)
                         + resp('EVALSHA', rrel, 1, 'rsl:k', owner)))
        # Issue 21: the semaphore's permit pair (max 4, one permit) and the read-write lock's
        # read and write pairs, as the client sends them (one script per call).
        sem_dir = os.path.join(ROOT, 'dlock-runtime/src/backend/redis')
        sacq = load(open(os.path.join(sem_dir, 'semaphore_acquire.lua')).read())
        srel = load(open(os.path.join(sem_dir, 'semaphore_release.lua')).read())
        variants.append(('dlock semaphore permit', resp('EVALSHA', sacq, 3, 'dlock:sem:{s}', 'dlock:sem:{s}:z',
                                                       'dlock:sem:{s}:fence', owner, 4, 1, 30000, 90000)
                         + resp('EVALSHA', srel, 2, 'dlock:sem:{s}', 'dlock:sem:{s}:z', owner,
                                'dlock:sem:{s}:rel')))
        rw = load(script(None, 'rw.lua'))
        rwk = ('dlock:{r}:rw', 'dlock:{r}:rw:r', 'dlock:{r}:rw:fence')
        rwc = ('dlock:{r}:rw:rd', 'dlock:{r}:rw:wr')
        for side, acq, rel in (('read', 'ar', 'rr'), ('write', 'aw', 'rw')):
            variants.append((f'dlock rw {side}', resp('EVALSHA', rw, 3, *rwk, acq, owner, 30000, 90000, *rwc)
                             + resp('EVALSHA', rw, 3, *rwk, rel, owner, 0, 90000, *rwc)))
        # Reference shapes: scripts written for this bench that run the same sequence of server
        # commands as Redisson's RPermitExpirableSemaphore (tryAcquire: ZRANGEBYSCORE of expired
        # permits, GET, DECRBY, ZADD, PTTL; release: ZSCORE, ZREM, INCRBY, PUBLISH) and its
        # RReadWriteLock's first reader (HGET mode, HSET mode, HSET holder, SET + PEXPIRE of the
        # per-hold timeout key, PEXPIRE; unlock: HGET mode, HEXISTS, HINCRBY, HDEL, DEL timeout key,
        # HLEN, DEL, PUBLISH), uncontended. Not Redisson's code (no fencing, client clock).
        pacq = load("""local e = redis.call('ZRANGEBYSCORE', KEYS[2], 0, ARGV[3], 'LIMIT', 0, 1)
local v = redis.call('GET', KEYS[1])
if v ~= false and tonumber(v) >= 1 then
  redis.call('DECRBY', KEYS[1], 1); redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
  redis.call('PTTL', KEYS[1]); return 'OK'
end
return nil""")
        prel = load("""local x = redis.call('ZSCORE', KEYS[2], ARGV[1])
if redis.call('ZREM', KEYS[2], ARGV[1]) ~= 1 then return 0 end
local v = redis.call('INCRBY', KEYS[1], 1); redis.call('PUBLISH', KEYS[3], v); return 1""")
        q('SET', 'rs:{s}', '1000000000')
        variants.append(('shape: expirable-semaphore', resp('EVALSHA', pacq, 2, 'rs:{s}', 'rs:{s}:timeout', owner,
                                                           '9999999999999', '1700000000000')
                         + resp('EVALSHA', prel, 3, 'rs:{s}', 'rs:{s}:timeout', 'rs:{s}:ch', owner)))
        racq = load("""local m = redis.call('HGET', KEYS[1], 'mode')
if m == false then
  redis.call('HSET', KEYS[1], 'mode', 'read'); redis.call('HSET', KEYS[1], ARGV[2], 1)
  redis.call('SET', KEYS[2] .. ':1', 1); redis.call('PEXPIRE', KEYS[2] .. ':1', ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[1]); return nil
end
return redis.call('PTTL', KEYS[1])""")
        rrel = load("""local m = redis.call('HGET', KEYS[1], 'mode')
if m == false then redis.call('PUBLISH', KEYS[2], 0); return 1 end
if redis.call('HEXISTS', KEYS[1], ARGV[2]) == 0 then return nil end
local c = redis.call('HINCRBY', KEYS[1], ARGV[2], -1)
if c == 0 then redis.call('HDEL', KEYS[1], ARGV[2]) end
redis.call('DEL', KEYS[3] .. ':' .. (c + 1))
if redis.call('HLEN', KEYS[1]) > 1 then return 0 end
redis.call('DEL', KEYS[1]); redis.call('PUBLISH', KEYS[2], 0); return 1""")
        variants.append(('shape: rw first reader', resp('EVALSHA', racq, 2, 'rr:{r}', 'rr:{r}:t', 30000, owner)
                         + resp('EVALSHA', rrel, 3, 'rr:{r}', 'rr:{r}:ch', 'rr:{r}:t', 30000, owner)))
        print(f'pairs per variant: {N}; server instructions per pair (callgrind, includes network I/O)')
        for rnd in range(2):
            for label, one in variants:
                subprocess.run(cli + ['--pipe'], input=one * 200, capture_output=True, check=True)
                ctl('-z')
                subprocess.run(cli + ['--pipe'], input=one * N, capture_output=True, check=True)
                ctl('-d')
                time.sleep(0.3)
                dump = sorted(glob.glob(out + '*'), key=os.path.getmtime)[-1]
                total = next(int(l.split()[1]) for l in open(dump)
                             if l.startswith('summary:') or l.startswith('totals:'))
                if rnd == 1:
                    print(f'{label:24} {total / N:10.0f}', flush=True)
    finally:
        srv.kill(); srv.wait()


main()
