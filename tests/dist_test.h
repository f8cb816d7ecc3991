/* What the tests of <cubuf/dist.h> share: open-fd counts and dma-buf checks. */
#ifndef CUBUF_DIST_TEST_H
#define CUBUF_DIST_TEST_H

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include "cubuf/dist.h"
#include "test.h"

/* The fds this process has open now. */
__attribute__((unused)) static int dist_open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d) {
        perror("opendir /proc/self/fd");
        exit(1);
    }
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n - 1; /* the directory's own fd */
}

/* Whether fd is a dma-buf of `size` bytes: its size is where SEEK_END lands,
 * and the kernel's fdinfo of a dma-buf names its exporter (exp_name). */
__attribute__((unused)) static bool dist_is_dmabuf(int fd, uint64_t size)
{
    off_t end = lseek(fd, 0, SEEK_END);
    if (end < 0 || (uint64_t)end != size) {
        fprintf(stderr, "fd %d: lseek(SEEK_END) gives %lld, expected %llu\n", fd, (long long)end,
                (unsigned long long)size);
        return false;
    }
    char path[64], text[4096];
    snprintf(path, sizeof path, "/proc/self/fdinfo/%d", fd);
    int f = open(path, O_RDONLY | O_CLOEXEC);
    if (f < 0) {
        perror(path);
        return false;
    }
    ssize_t n = read(f, text, sizeof text - 1);
    close(f);
    text[n > 0 ? n : 0] = 0;
    if (!strstr(text, "exp_name")) {
        fprintf(stderr, "fd %d: %s has no exp_name: not a dma-buf:\n%s\n", fd, path, text);
        return false;
    }
    int flags = fcntl(fd, F_GETFD);
    if (flags < 0 || !(flags & FD_CLOEXEC)) {
        fprintf(stderr, "fd %d: not close-on-exec\n", fd);
        return false;
    }
    return true;
}

/* A refused call: the status, and no fd opened. */
#define T_REFUSED(expr, status)                                                  \
    do {                                                                         \
        int t_fds_ = dist_open_fds();                                            \
        T_STATUS(expr, status);                                                  \
        T_CHECK(dist_open_fds() == t_fds_);                                      \
    } while (0)

#endif
