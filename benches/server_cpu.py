#!/usr/bin/env python3
"""Server CPU per acquire+release pair, one run, one private redis-server (issue 7, deliverable 5).

Runs N pairs of each variant through `redis-cli --pipe` (EVALSHA of the scripts, no client logic)
against a private `redis-server` on a free loopback port, pinned with the client to one core
(`taskset -c 0`), and reports per pair: the commands' own time (INFO commandstats, top-level
commands only) and the server's whole CPU (INFO cpu used_cpu_user+sys, includes network I/O).
Usage: python3 benches/server_cpu.py [pairs]   (default 200000)
"""
import os, socket, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, '..', 'dlock-runtime', 'src', 'scripts')
N = int(sys.argv[1]) if len(sys.argv) > 1 else 200000

MIN_ACQ = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], ARGV[1], 1); redis.call('PEXPIRE', KEYS[1], ARGV[2]); return nil
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[1], 1); redis.call('PEXPIRE', KEYS[1], ARGV[2]); return nil
end
return redis.call('PTTL', KEYS[1])"""
MIN_REL = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return nil end
local c = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
if c > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]); return 0 end
redis.call('DEL', KEYS[1]); redis.call('PUBLISH', ARGV[3], '1'); return 1"""
RSL_REL = """if redis.call("get",KEYS[1]) == ARGV[1] then return redis.call("del",KEYS[1]) else return 0 end"""

def resp(*a):
    out = [b'*%d\r\n' % len(a)]
    for x in a:
        x = x if isinstance(x, bytes) else str(x).encode()
        out.append(b'$%d\r\n%s\r\n' % (len(x), x))
    return b''.join(out)

def free_port():
    s = socket.socket(); s.bind(('127.0.0.1', 0)); p = s.getsockname()[1]; s.close(); return p

def main():
    port = free_port(); d = tempfile.mkdtemp()
    srv = subprocess.Popen(['taskset', '-c', '0', 'redis-server', '--port', str(port), '--bind', '127.0.0.1',
                            '--save', '', '--appendonly', 'no', '--dir', d], stdout=subprocess.DEVNULL)
    cli = ['redis-cli', '-p', str(port)]
    try:
        for _ in range(100):
            if subprocess.run(cli + ['PING'], capture_output=True).stdout.strip() == b'PONG': break
            time.sleep(0.05)
        def q(*a): return subprocess.run(cli + list(a), capture_output=True, check=True).stdout.decode()
        def load(src): return q('SCRIPT', 'LOAD', src).strip()
        acq = load(open(os.path.join(SCRIPTS, 'acquire.lua')).read())
        rel = load(open(os.path.join(SCRIPTS, 'release.lua')).read())
        macq, mrel, rrel = load(MIN_ACQ), load(MIN_REL), load(RSL_REL)
        owner = 'o:0123456789abcdef:1'
        variants = {
            'dlock': lambda: resp('EVALSHA', acq, 2, 'dlock:{k}', 'dlock:{k}:fence', owner, 30000, 90000)
                             + resp('EVALSHA', rel, 1, 'dlock:{k}', owner, 0, 'dlock:{k}:rel', 1),
            'minimal': lambda: resp('EVALSHA', macq, 1, 'min:{k}', owner, 30000)
                               + resp('EVALSHA', mrel, 1, 'min:{k}', owner, 30000, 'min:{k}:rel'),
            'rslock': lambda: resp('SET', 'rsl:k', owner, 'NX', 'PX', 30000)
                              + resp('EVALSHA', rrel, 1, 'rsl:k', owner),
        }
        def info():
            stats, cpu = {}, 0.0
            for line in q('INFO', 'all').splitlines():
                if line.startswith('cmdstat_'):
                    name, rest = line.split(':', 1)
                    f = dict(kv.split('=') for kv in rest.split(','))
                    stats[name[8:]] = (int(f['calls']), int(f['usec']))
                elif line.startswith('used_cpu_user:') or line.startswith('used_cpu_sys:'):
                    cpu += float(line.split(':')[1])
            return stats, cpu
        print(f'pairs per variant: {N}; redis-server and redis-cli --pipe pinned to core 0')
        print(f'{"variant":10} {"cmd µs/pair":>12} {"cpu µs/pair":>12}  calls/pair (top level + nested)')
        for rnd in range(2):
            for name, mk in variants.items():
                one = mk(); data = one * N
                q('CONFIG', 'RESETSTAT'); _, c0 = info()
                subprocess.run(['taskset', '-c', '0'] + cli + ['--pipe'], input=data, capture_output=True, check=True)
                st, c1 = info()
                top = {'evalsha', 'set'} if name == 'rslock' else {'evalsha'}
                us = sum(v[1] for k, v in st.items() if k in top) / N
                calls = sum(v[0] for k, v in st.items() if k not in ('config', 'info')) / N
                if rnd == 1:
                    print(f'{name:10} {us:12.2f} {(c1 - c0) * 1e6 / N:12.2f}  {calls:.1f}  '
                          + ' '.join(f'{k}={v[0]/N:.1f}' for k, v in sorted(st.items()) if k not in ('config', 'info')))
    finally:
        srv.kill(); srv.wait()

if __name__ == '__main__':
    main()
