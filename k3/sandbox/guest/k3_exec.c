/* k3-exec FILTER NPROC ARGV...: the first process of every command in a gVisor sandbox. It sets
 * RLIMIT_NPROC to NPROC, loads the seccomp filter from FILTER (classic BPF, as k3/sandbox/seccomp.py writes
 * it), so the command and every process it starts inherit both, then execs ARGV. bubblewrap does the same itself with --seccomp. */
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

int main(int argc, char **argv) {
    static struct sock_filter insns[4096];
    if (argc < 4) {
        fprintf(stderr, "usage: k3-exec FILTER NPROC ARGV...\n");
        return 127;
    }
    struct rlimit nproc = {.rlim_cur = strtoul(argv[2], NULL, 10), .rlim_max = strtoul(argv[2], NULL, 10)};
    if (setrlimit(RLIMIT_NPROC, &nproc)) {
        perror("k3-exec: RLIMIT_NPROC");
        return 127;
    }
    int fd = open(argv[1], O_RDONLY);
    ssize_t n = fd < 0 ? -1 : read(fd, insns, sizeof insns);
    if (n <= 0 || n % sizeof insns[0] != 0) {
        perror("k3-exec: reading the seccomp filter");
        return 127;
    }
    close(fd);
    struct sock_fprog prog = {.len = (unsigned short)(n / sizeof insns[0]), .filter = insns};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) {
        perror("k3-exec: loading the seccomp filter");
        return 127;
    }
    execvp(argv[3], argv + 3);
    perror("k3-exec: exec");
    return 127;
}
