/* Preloaded in gVisor sandboxes built from host files (/etc/ld.so.preload). The gVisor packaged in Debian 12
 * (release 20221219) rejects statx() with AT_NO_AUTOMOUNT, which coreutils 9 always passes, so `ls` and
 * `stat` fail with EINVAL. The flag only matters for automount points, which a sandbox has none of. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf) {
    return syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
}
