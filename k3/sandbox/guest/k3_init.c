/* k3-init: PID 1 of every gVisor sandbox. It reaps every orphan, so exited processes do not pile up as
 * zombies, and otherwise sleeps; static, so it runs on any template. */
#include <sys/wait.h>
#include <unistd.h>

int main(void) {
    for (;;) {
        if (wait(NULL) < 0)
            sleep(1);
    }
}
