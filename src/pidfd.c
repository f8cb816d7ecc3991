/* Descriptors whose fds are taken from the exporting process by pid
 * (pidfd_open + pidfd_getfd, Linux 5.6) instead of over a socket
 * (include/cubuf/dist.h). No driver call is made here. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "dist.h"

#if defined(SYS_pidfd_open) && defined(SYS_pidfd_getfd)
static int sys_pidfd_open(pid_t pid) { return (int)syscall(SYS_pidfd_open, pid, 0); }
static int sys_pidfd_getfd(int pidfd, int fd) { return (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0); }
#else
static int sys_pidfd_open(pid_t pid)
{
    (void)pid;
    errno = ENOSYS;
    return -1;
}
static int sys_pidfd_getfd(int pidfd, int fd)
{
    (void)pidfd;
    (void)fd;
    errno = ENOSYS;
    return -1;
}
#endif

static cubuf_status_t refused(int e, const char *call, pid_t pid, int fd, size_t index, size_t n)
{
    static const char what[] = "cubuf_ipc_descriptor_from_pid";
    char where[64] = "";
    if (fd >= 0) snprintf(where, sizeof where, " of fd %d (%zu of %zu)", fd, index + 1, n);
    switch (e) {
    case ENOSYS:
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "%s: %s is not available (ENOSYS: a kernel before 5.6, or a seccomp "
                           "filter); pass the fds over a socket (cubuf_ipc_send/cubuf_ipc_recv)",
                           what, call);
    case EPERM:
        return cubuf__fail(CUBUF_ERROR_SYSTEM,
                           "%s: %s%s in process %d: EPERM: no permission to take fds from that "
                           "process (it needs ptrace access: same user and "
                           "kernel.yama.ptrace_scope 0, its parent, or CAP_SYS_PTRACE); pass the "
                           "fds over a socket instead (cubuf_ipc_send/cubuf_ipc_recv)",
                           what, call, where, (int)pid);
    case EBADF:
        if (fd >= 0)
            return cubuf__fail(CUBUF_ERROR_INVALID_DESCRIPTOR,
                               "%s: fd %d (%zu of %zu) is not open in process %d", what, fd,
                               index + 1, n, (int)pid);
        break;
    case ESRCH:
        return cubuf__fail(CUBUF_ERROR_SYSTEM, "%s: %s: no process %d (ESRCH: it exited?)", what,
                           call, (int)pid);
    default: break;
    }
    return cubuf__fail(CUBUF_ERROR_SYSTEM, "%s: %s%s in process %d: %s", what, call, where, (int)pid,
                       strerror(e));
}

cubuf_status_t cubuf_ipc_descriptor_from_pid(pid_t pid, const void *bytes, size_t len, const int *fds,
                                             size_t nfds, cubuf_ipc_descriptor_t **out)
{
    static const char what[] = "cubuf_ipc_descriptor_from_pid";
    CHECK_ARG(out, "%s: out is NULL", what);
    CHECK_ARG(pid > 0, "%s: pid %d is not a process id", what, (int)pid);
    CHECK_ARG(bytes || len == 0, "%s: bytes is NULL with length %zu", what, len);
    CHECK_ARG(fds || nfds == 0, "%s: fds is NULL with count %zu", what, nfds);
    if (nfds > CUBUF_IPC_MAX_FDS)
        return cubuf__fail(CUBUF_ERROR_INVALID_DESCRIPTOR, "%s: %zu fds, at most %d", what, nfds,
                           CUBUF_IPC_MAX_FDS);
    int *local = NULL;
    if (nfds && !(local = cubuf__malloc(nfds * sizeof *local)))
        return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: cannot allocate %zu fd slots", what, nfds);
    size_t got = 0;
    cubuf_status_t st = CUBUF_SUCCESS;
    int pidfd = -1;
    if (nfds) {
        if ((pidfd = sys_pidfd_open(pid)) < 0) {
            st = refused(errno, "pidfd_open", pid, -1, 0, nfds);
            goto out;
        }
        for (; got < nfds; got++) {
            if (fds[got] < 0) {
                st = cubuf__fail(CUBUF_ERROR_INVALID_DESCRIPTOR, "%s: fd %zu of %zu is %d", what,
                                 got + 1, nfds, fds[got]);
                goto out;
            }
            /* The kernel makes the copy close-on-exec. */
            if ((local[got] = sys_pidfd_getfd(pidfd, fds[got])) < 0) {
                st = refused(errno, "pidfd_getfd", pid, fds[got], got, nfds);
                goto out;
            }
        }
    }
    st = cubuf_ipc_descriptor_deserialize(bytes, len, local, nfds, out);
out:
    if (st != CUBUF_SUCCESS)
        for (size_t i = 0; i < got; i++) close(local[i]);
    if (pidfd >= 0) close(pidfd);
    free(local);
    return st;
}
