/* k3-init: PID 1 of every gVisor sandbox. It reaps every orphan as soon as it has exited: the dead of a
 * command's tree count against the sandbox's RLIMIT_NPROC until they are reaped, so a slow init leaves the
 * next command unable to fork. Static, so it runs on any template. */
#include <signal.h>
#include <sys/wait.h>
#include <time.h>

int main(void) {
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL); /* kept pending for sigtimedwait */
    struct timespec backstop = {0, 100 * 1000000L}; /* a SIGCHLD that never comes costs at most 100 ms */
    for (;;) {
        while (waitpid(-1, NULL, WNOHANG) > 0) {}
        sigtimedwait(&chld, NULL, &backstop);
    }
}
