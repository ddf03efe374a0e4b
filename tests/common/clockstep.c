/*
 * A minimal LD_PRELOAD clock shim for tests/redis_clock.rs: steps the wall clock of a process
 * (redis-server) while it runs. Debian's libfaketime 0.9.10 cannot be used: redis-server aborts
 * at start under it ("unexpected recursive calls to clock_gettime()": jemalloc, linked into
 * redis-server, reads the clock while libfaketime initialises, and libfaketime's initialisation
 * allocates). This shim allocates nothing and resolves no symbol: it calls the kernel directly.
 *
 * CLOCK_REALTIME readings (clock_gettime with CLOCK_REALTIME / CLOCK_REALTIME_COARSE,
 * gettimeofday, time) are shifted by a signed offset in nanoseconds: the first 8 bytes (native
 * endian int64) of the file named by DLOCK_CLOCK_OFFSET_FILE, mapped shared, so a test steps the
 * clock by rewriting those bytes in place. Monotonic clocks are not touched.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static volatile int64_t *offset_ns;
static volatile int tried;

static int64_t offset(void) {
    if (!tried) {
        tried = 1;
        const char *path = getenv("DLOCK_CLOCK_OFFSET_FILE");
        if (path) {
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd >= 0) {
                void *m = mmap(0, sizeof(int64_t), PROT_READ, MAP_SHARED, fd, 0);
                close(fd);
                if (m != MAP_FAILED)
                    offset_ns = (volatile int64_t *)m;
            }
        }
    }
    return offset_ns ? *offset_ns : 0;
}

int clock_gettime(clockid_t clk, struct timespec *ts) {
    int r = (int)syscall(SYS_clock_gettime, clk, ts);
    if (r == 0 && (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE)) {
        int64_t ns = (int64_t)ts->tv_sec * 1000000000LL + ts->tv_nsec + offset();
        ts->tv_sec = (time_t)(ns / 1000000000LL);
        ts->tv_nsec = (long)(ns % 1000000000LL);
    }
    return r;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    (void)tz;
    struct timespec ts;
    int r = clock_gettime(CLOCK_REALTIME, &ts);
    if (r == 0) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return r;
}

time_t time(time_t *t) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return (time_t)-1;
    if (t)
        *t = ts.tv_sec;
    return ts.tv_sec;
}
