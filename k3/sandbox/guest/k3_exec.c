/* k3-exec FILTER NPROC PIDS MEMORY CPU_MS MARK ARGV...: the first process of every command in a gVisor sandbox and
 * the command's supervisor inside the guest kernel. It forks ARGV with RLIMIT_NPROC = NPROC (the sandbox-wide
 * backstop) and the seccomp filter from FILTER (classic BPF, as k3/sandbox/seccomp.py writes it), makes
 * it the leader of a new session (which its processes keep, orphans included), and every TICK_MS sums the
 * tree's resident memory (less file-backed pages; as this guest counts a page shared after fork in each
 * process, the figure is capped by the whole guest's AnonPages, which count it once) and counts its
 * processes and their CPU time from the guest's /proc. When the tree passes MEMORY bytes, holds PIDS
 * processes (its dead not yet reaped by init included: they count against RLIMIT_NPROC) or has used CPU_MS
 * milliseconds of CPU (0: no limit), even after its first process has ended, or on SIGUSR1 (the host's
 * "kill this command"), it first writes "MARK killed_by=<why>" on stderr, then SIGKILLs the whole tree and
 * waits until init has reaped it, so the guest ends the command and the sandbox lives on, able to fork. SIGTERM,
 * SIGINT and SIGHUP are passed to the command. When ARGV's first process ends, the processes of its tree
 * that still hold the command's stdout or stderr are killed (as bubblewrap's pid namespace ends them) and,
 * once the tree has settled (scans in a row find no holder and the same processes: a leftover that is
 * still forking stays under the limits until it settles or a limit ends it), it exits with that first
 * process's status (128 + signal if killed); processes started in the background with their own output
 * (`nohup cmd >log 2>&1 &`) keep running, outside its watch. Before it starts a command, and before it returns
 * from one whose tree held more than its first process (or that it killed), it waits until ROOM + 1 processes
 * under NPROC can live at once. */
#include <dirent.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TICK_MS 5
#define MAX_PROCS 4096
#define GRACE_TICKS 40 /* after the first process ends, 200 ms for a background child to redirect its output */
#define KILL_GIVE_UP_S 30.0 /* a tree that still has processes after this long is left (the host gave up before) */
#define FORKABLE_GIVE_UP_S 5.0 /* how long a command waits for the sandbox to fork again */
#define ROOM 3 /* with the prober that forks them, room for 4 processes: a shell, a pipeline of two, one more */

static volatile sig_atomic_t kill_requested = 0;
static volatile pid_t child = -1;

/* The host's "kill this command": the command's process group dies here, in the handler (kill() is
 * async-signal-safe), not at the end of the tick. Under a fork bomb on gVisor's ptrace platform a tick's
 * /proc scan can take seconds; the handler runs as soon as this task next gets the CPU. */
static void on_usr1(int sig) {
    (void)sig;
    kill_requested = 1;
    if (child > 0) kill(-child, SIGKILL);
}
static void forward(int sig) { if (child > 0) kill(child, sig); }

/* The command's processes: those in its session (the child's, made by setsid) and those under `self` by
 * parent links in /proc (this gVisor has no subreapers, so orphans go to init but keep their session).
 * Their pids go into `out` (out[0] is self, not counted), their resident bytes into `rss`. */
static int tree(pid_t self, pid_t *out, long long *rss, long long *cpu_ticks) {
    static pid_t pid[MAX_PROCS], ppid[MAX_PROCS], sid[MAX_PROCS];
    static unsigned long ticks[MAX_PROCS];
    int n = 0, found = 0;
    DIR *d = opendir("/proc");
    struct dirent *e;
    while (d && (e = readdir(d)) && n < MAX_PROCS) {
        char path[300], buf[512];
        if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
        snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
        int fd = open(path, O_RDONLY);
        if (fd < 0) continue;
        ssize_t len = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (len <= 0) continue;
        buf[len] = 0;
        char *close_paren = strrchr(buf, ')'); /* "pid (comm) state ppid pgrp session ... utime stime" */
        int pgrp;
        unsigned long utime, stime;
        if (!close_paren || sscanf(close_paren + 2, "%*c %d %d %d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ppid[n],
                                   &pgrp, &sid[n], &utime, &stime) != 5)
            continue;
        ticks[n] = utime + stime;
        pid[n] = atoi(buf);
        /* a task that died while being read shows pid 0 here (gVisor: it has left the pid namespace);
         * kill(0) would end this supervisor's own process group, so it is skipped */
        if (pid[n] != atoi(e->d_name)) continue;
        n++;
    }
    if (d) closedir(d);
    *rss = 0;
    *cpu_ticks = 0;
    long page = sysconf(_SC_PAGESIZE);
    static char in[MAX_PROCS];
    memset(in, 0, sizeof in);
    out[found++] = self;
    for (int j = 0; j < n; j++)
        if (child > 0 && sid[j] == child && pid[j] != self) out[found++] = pid[j], in[j] = 1;
    for (int i = 0; i < found && found < MAX_PROCS; i++) /* breadth-first from self and the session */
        for (int j = 0; j < n && found < MAX_PROCS; j++)
            if (!in[j] && ppid[j] == out[i] && pid[j] != self) out[found++] = pid[j], in[j] = 1;
    for (int j = 0; j < n; j++)
        if (in[j]) *cpu_ticks += ticks[j];
    for (int i = 1; i < found; i++) {
        char path[64], buf[128];
        snprintf(path, sizeof path, "/proc/%d/statm", out[i]);
        int fd = open(path, O_RDONLY);
        ssize_t len = fd < 0 ? -1 : read(fd, buf, sizeof buf - 1);
        if (fd >= 0) close(fd);
        long long size, resident, shared;
        if (len > 0) {
            buf[len] = 0; /* statm: size resident shared ...; file-backed pages (shared) are not the tree's */
            if (sscanf(buf, "%lld %lld %lld", &size, &resident, &shared) == 3) *rss += (resident - shared) * page;
        }
    }
    return found - 1;
}

/* The whole sandbox's anonymous memory (the guest kernel's AnonPages, in which a page shared after fork
 * counts once), in bytes; -1 if unknown. */
static long long anon_bytes(void) {
    char buf[4096];
    int fd = open("/proc/meminfo", O_RDONLY);
    ssize_t len = fd < 0 ? -1 : read(fd, buf, sizeof buf - 1);
    if (fd >= 0) close(fd);
    if (len <= 0) return -1;
    buf[len] = 0;
    char *at = strstr(buf, "AnonPages:");
    return at ? atoll(at + 10) * 1024 : -1;
}

/* CPU time of the command's processes already reaped (by this supervisor, or by their reaped parents), in
 * clock ticks. */
static long long reaped_ticks(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_CHILDREN, &ru)) return 0;
    long long us = (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000LL + ru.ru_utime.tv_usec + ru.ru_stime.tv_usec;
    return us * sysconf(_SC_CLK_TCK) / 1000000;
}

/* SIGKILL one process of the tree: never 0 or a negative number (a process group: kill(0) is this
 * supervisor's own group), never the supervisor itself. */
static void kill_one(pid_t pid, pid_t self) {
    if (pid > 0 && pid != self) kill(pid, SIGKILL);
}

static double seconds_since(const struct timespec *start) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - start->tv_sec) + (now.tv_nsec - start->tv_nsec) / 1e9;
}

/* Ends the command's tree: done once two scans in a row find nothing (one scan can miss a child forked by
 * a parent that died before the scan read it), or after KILL_GIVE_UP_S. */
static void kill_tree(pid_t self) {
    static pid_t procs[MAX_PROCS];
    long long rss, cpu;
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int empty = 0; empty < 2 && seconds_since(&start) < KILL_GIVE_UP_S;) {
        /* the command's process group at once, on every pass: a process forked while the group was being
         * killed can outlive that kill (seen on gVisor), and a fork bomb refills the group between passes */
        kill(-child, SIGKILL);
        int n = tree(self, procs, &rss, &cpu); /* then whoever left the group */
        empty = n == 0 ? empty + 1 : 0;
        for (int i = 1; i <= n; i++) kill_one(procs[i], self);
        while (waitpid(-1, NULL, WNOHANG) > 0) {}
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
}

/* Returns once ROOM + 1 processes under the command's RLIMIT_NPROC can live at once beside the sandbox's others
 * (or after FORKABLE_GIVE_UP_S). A tree's dead may still count against the limit when they no longer show in
 * the guest's /proc (once, in a CI run, the command after a fork bomb that had died out could not fork), and
 * a tree whose kill the host stopped waiting for may still be dying: a command starts, and a crowded one
 * returns, only once the sandbox can fork again. A prober child takes the limit and forks ROOM children that
 * wait on a pipe until all of them exist, and tries again until that works. */
static void wait_for_room(rlim_t nproc) {
    pid_t prober = fork();
    if (prober < 0) return;
    if (prober == 0) {
        struct rlimit lim = {.rlim_cur = nproc, .rlim_max = nproc};
        struct timespec start, pause = {0, 2000000};
        clock_gettime(CLOCK_MONOTONIC, &start);
        if (setrlimit(RLIMIT_NPROC, &lim)) _exit(1);
        while (seconds_since(&start) < FORKABLE_GIVE_UP_S) {
            int hold[2], born = 0;
            char byte;
            if (pipe(hold)) _exit(1);
            for (; born < ROOM; born++) {
                pid_t p = fork();
                if (p < 0) break;
                if (p == 0) { /* waits until the prober closes its end: all ROOM lived at once */
                    close(hold[1]);
                    while (read(hold[0], &byte, 1) < 0) {}
                    _exit(0);
                }
            }
            close(hold[0]);
            close(hold[1]);
            while (wait(NULL) > 0) {}
            if (born == ROOM) _exit(0);
            nanosleep(&pause, NULL);
        }
        _exit(1);
    }
    waitpid(prober, NULL, 0);
}

/* SIGKILL (if `really`) the processes of the tree that still hold this command's stdout or stderr (when
 * its first process has ended they would keep the command open, as bubblewrap's pid namespace would not);
 * those started with their own output live on. Returns how many there were. */
static int end_holders(const pid_t *procs, int n, int really, pid_t self) {
    char mine[2][64] = {{0}}, theirs[64], path[64];
    int held = 0;
    for (int fd = 1; fd <= 2; fd++) {
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        if (readlink(path, mine[fd - 1], sizeof mine[0] - 1) < 0) mine[fd - 1][0] = 0;
    }
    for (int i = 1; i <= n; i++)
        for (int fd = 0; fd < 64; fd++) { /* any of its first descriptors */
            snprintf(path, sizeof path, "/proc/%d/fd/%d", procs[i], fd);
            ssize_t len = readlink(path, theirs, sizeof theirs - 1);
            if (len < 0) continue;
            theirs[len] = 0;
            if ((mine[0][0] && !strcmp(theirs, mine[0])) || (mine[1][0] && !strcmp(theirs, mine[1]))) {
                if (really) kill_one(procs[i], self);
                held++;
                break;
            }
        }
    return held;
}

static int load_filter(const char *file) {
    static struct sock_filter insns[4096];
    int fd = open(file, O_RDONLY);
    ssize_t n = fd < 0 ? -1 : read(fd, insns, sizeof insns);
    if (fd >= 0) close(fd);
    if (n <= 0 || n % sizeof insns[0] != 0) return -1;
    struct sock_fprog prog = {.len = (unsigned short)(n / sizeof insns[0]), .filter = insns};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

static int by_pid(const void *a, const void *b) { return *(const pid_t *)a - *(const pid_t *)b; }

int main(int argc, char **argv) {
    static pid_t procs[MAX_PROCS], last[MAX_PROCS];
    int last_n = 0; /* the processes of the last scan: none before the first */
    if (argc < 8) {
        fprintf(stderr, "usage: k3-exec FILTER NPROC PIDS MEMORY CPU_MS MARK ARGV...\n");
        return 127;
    }
    rlim_t nproc = strtoul(argv[2], NULL, 10);
    long pids = strtol(argv[3], NULL, 10);
    long long memory = strtoll(argv[4], NULL, 10);
    long long cpu_ms = strtoll(argv[5], NULL, 10);
    const char *mark = argv[6];
    long clk_tck = sysconf(_SC_CLK_TCK);
    pid_t self = getpid();
    struct sigaction sa = {0};
    sa.sa_handler = on_usr1;
    sigaction(SIGUSR1, &sa, NULL);
    sa.sa_handler = forward;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    /* if the host has stopped reading (it gave up on a starved supervisor), the "killed_by" line must not
     * end this supervisor before it has ended the tree */
    signal(SIGPIPE, SIG_IGN);
    wait_for_room(nproc);
    child = fork();
    if (child < 0) {
        perror("k3-exec: fork");
        return 127;
    }
    if (child == 0) {
        signal(SIGUSR1, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        signal(SIGINT, SIG_DFL);
        signal(SIGHUP, SIG_DFL);
        signal(SIGPIPE, SIG_DFL);
        setsid();
        struct rlimit lim = {.rlim_cur = nproc, .rlim_max = nproc};
        if (setrlimit(RLIMIT_NPROC, &lim)) {
            perror("k3-exec: RLIMIT_NPROC");
            _exit(127);
        }
        if (load_filter(argv[1])) {
            perror("k3-exec: loading the seccomp filter");
            _exit(127);
        }
        execvp(argv[7], argv + 7);
        perror("k3-exec: exec");
        _exit(127);
    }
    const char *why = NULL;
    int status = 0, done = 0, ticks_done = 0, quiet = 0, crowded = 0;
    for (;;) {
        pid_t p;
        int st;
        while ((p = waitpid(-1, &st, WNOHANG)) > 0)
            if (p == child) status = st, done = 1;
        long long rss, anon, cpu;
        int n = tree(self, procs, &rss, &cpu);
        crowded |= n > 1; /* more than the command's first process: its dead may outlast the scans */
        if (kill_requested) why = "signal";
        else if (n > 0 || !done) { /* the limits, before whether it is over, while anything of the tree is
                                    * left (a fork bomb whose first process has ended is still a fork bomb) */
            if (memory > 0 && rss > memory && (anon = anon_bytes()) >= 0 && anon < rss) rss = anon;
            if (memory > 0 && rss > memory) why = "oom";
            else if (pids > 0 && n >= pids) why = "pids";
            else if (cpu_ms > 0 && (cpu + reaped_ticks()) * 1000 / clk_tck > cpu_ms) why = "cpu";
        }
        if (why) { /* the reason first (one write), so it is on record whatever happens while killing */
            fprintf(stderr, "%s killed_by=%s\n", mark, why);
            kill_tree(self);
            waitpid(child, &status, 0);
            wait_for_room(nproc);
            return 128 + SIGKILL;
        }
        if (done) { /* over once two scans in a row find nothing holding the output and the processes of
                     * the scan before (as in kill_tree); a tree whose processes come and go (a fork bomb
                     * whose holders have just died: its processes are caught between fork and exit) is not */
            int held = n > 0 && end_holders(procs, n, ++ticks_done > GRACE_TICKS, self);
            qsort(procs + 1, n, sizeof procs[0], by_pid);
            int same = n == last_n && !memcmp(procs + 1, last, n * sizeof procs[0]);
            memcpy(last, procs + 1, n * sizeof procs[0]);
            last_n = n;
            quiet = held || !same ? 0 : quiet + 1;
            if (quiet == 2) break;
            if (quiet == 1) continue; /* the second scan at once */
        }
        struct timespec ts = {0, TICK_MS * 1000000L};
        nanosleep(&ts, NULL);
    }
    if (crowded) wait_for_room(nproc);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
