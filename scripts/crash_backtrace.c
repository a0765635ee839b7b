/* Where a process died, for machines without a debugger or core dumps.
 *
 * Preloaded (LD_PRELOAD=crash_backtrace.so), it catches SIGABRT, SIGSEGV, SIGBUS,
 * SIGFPE and SIGILL. On one it writes the dying thread's id and name, its backtrace
 * (glibc's backtrace(): frames as FILE(SYMBOL+OFFSET) or FILE(+OFFSET)), and the
 * process's executable mappings, then dies of the same signal. Output goes to stderr,
 * or appended to the file named by CRASH_BACKTRACE_FILE.
 *
 * Only async-signal-safe calls run in the handler, apart from backtrace(), which is
 * called once at load so that its unwinder is loaded before any crash (a heap that
 * glibc found corrupt must not be asked for memory). Rust's runtime leaves a SIGSEGV
 * handler that is already set in place, so this one also sees segfaults of a Rust
 * binary (at the cost of Rust's stack-overflow message).
 *
 * Build:  gcc -O2 -shared -fPIC -o crash_backtrace.so scripts/crash_backtrace.c
 * Names:  addr2line -f -C -e FILE OFFSET, with the same binaries
 *         (python3 scripts/stall_stacks.py --symbolize reads stall_stacks' own records).
 */
#define _GNU_SOURCE
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

static int out_fd = 2;

static void put(const char *s) {
    size_t n = strlen(s);
    while (n > 0) {
        ssize_t w = write(out_fd, s, n);
        if (w <= 0)
            return;
        s += w;
        n -= (size_t)w;
    }
}

static void put_number(long v) {
    char digits[24];
    int i = sizeof digits - 1;
    int negative = v < 0;
    unsigned long u = negative ? -(unsigned long)v : (unsigned long)v;
    digits[i] = '\0';
    do {
        digits[--i] = (char)('0' + u % 10);
        u /= 10;
    } while (u > 0 && i > 1);
    if (negative)
        digits[--i] = '-';
    put(&digits[i]);
}

/* The lines of /proc/self/maps whose permissions include x: what the offsets are in. */
static void put_executable_mappings(void) {
    int fd = open("/proc/self/maps", O_RDONLY);
    if (fd < 0)
        return;
    char buf[4096], line[1024];
    size_t len = 0;
    ssize_t got;
    while ((got = read(fd, buf, sizeof buf)) > 0) {
        for (ssize_t i = 0; i < got; i++) {
            if (len < sizeof line - 1)
                line[len++] = buf[i];
            if (buf[i] != '\n')
                continue;
            line[len] = '\0';
            /* "start-end perms ...": perms is the second field. */
            char *perms = strchr(line, ' ');
            if (perms != NULL && perms[3] == 'x')
                put(line);
            len = 0;
        }
    }
    close(fd);
}

static void on_fatal(int sig, siginfo_t *info, void *context) {
    (void)info;
    (void)context;
    char name[17] = {0};
    prctl(PR_GET_NAME, name, 0, 0, 0);
    put("\n=== crash_backtrace: signal ");
    put_number(sig);
    put(" in thread ");
    put_number(syscall(SYS_gettid));
    put(" (");
    put(name);
    put(") of process ");
    put_number(getpid());
    put("\n");
    void *frames[128];
    int n = backtrace(frames, 128);
    backtrace_symbols_fd(frames, n, out_fd);
    put("=== executable mappings\n");
    put_executable_mappings();
    put("=== end\n");
    /* SA_RESETHAND restored the default action: die of the same signal. */
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    void *warm[2];
    backtrace(warm, 2);
    const char *path = getenv("CRASH_BACKTRACE_FILE");
    if (path != NULL && *path != '\0') {
        int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (fd >= 0)
            out_fd = fd;
    }
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_fatal;
    action.sa_flags = SA_SIGINFO | SA_RESETHAND;
    sigemptyset(&action.sa_mask);
    const int fatal[] = {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL};
    for (size_t i = 0; i < sizeof fatal / sizeof fatal[0]; i++)
        sigaction(fatal[i], &action, NULL);
}
