/* One fuzz input through cubuf_ipc_descriptor_deserialize, with the
 * properties every input must keep. Shared by the libFuzzer target and
 * tests/test_ipc_wire.c (which runs it without libFuzzer). Header-only.
 *
 * Properties: never a crash; a status that is SUCCESS or
 * INVALID_DESCRIPTOR (OUT_OF_MEMORY aside); on failure every fd passed is
 * still open and owned by the caller; on success serialize gives back the
 * same bytes and fds (the format is canonical), and destroy closes the fds;
 * no fd leaks either way. A broken property aborts. */
#ifndef CUBUF_IPC_FUZZ_ONE_H
#define CUBUF_IPC_FUZZ_ONE_H

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cubuf.h"

#define IPC_FUZZ_MAX_FDS 300

static inline void ipc_fuzz_fail(const char *what)
{
    fprintf(stderr, "ipc fuzz property broken: %s (%s)\n", what, cubuf_last_error());
    abort();
}

/* The fds to pass: the count the header announces when it is small enough,
 * else a few; the top bit of the last byte asks for one fd more, so counts
 * that differ from the header's are exercised too. */
static inline size_t ipc_fuzz_nfds(const uint8_t *data, size_t size)
{
    size_t n = 0;
    if (size >= 20) {
        uint32_t announced = (uint32_t)data[16] | (uint32_t)data[17] << 8 | (uint32_t)data[18] << 16 |
                             (uint32_t)data[19] << 24;
        n = announced < IPC_FUZZ_MAX_FDS ? announced : data[0] & 3u;
    }
    if (size && (data[size - 1] & 0x80) && n < IPC_FUZZ_MAX_FDS) n++;
    return n;
}

/* Returns 1 if the input made a descriptor, 0 if it was refused. */
static inline int ipc_fuzz_one(const uint8_t *data, size_t size)
{
    static int devnull = -1;
    if (devnull < 0) devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (devnull < 0) ipc_fuzz_fail("cannot open /dev/null");
    int probe_before = dup(devnull);
    close(probe_before);

    size_t nfds = ipc_fuzz_nfds(data, size);
    int fds[IPC_FUZZ_MAX_FDS];
    for (size_t i = 0; i < nfds; i++) {
        fds[i] = fcntl(devnull, F_DUPFD_CLOEXEC, 0);
        if (fds[i] < 0) ipc_fuzz_fail("cannot dup /dev/null");
    }
    cubuf_ipc_descriptor_t *d = NULL;
    cubuf_status_t st = cubuf_ipc_descriptor_deserialize(size ? data : NULL, size, fds, nfds, &d);
    int made = 0;
    if (st == CUBUF_SUCCESS) {
        if (!d) ipc_fuzz_fail("success without a descriptor");
        size_t len = 0, n = 0;
        if (cubuf_ipc_descriptor_serialize(d, NULL, &len, NULL, &n) != CUBUF_SUCCESS)
            ipc_fuzz_fail("serialize query failed");
        if (len != size || n != nfds) ipc_fuzz_fail("serialized sizes differ from the input");
        uint8_t *again = (uint8_t *)malloc(len);
        int back[IPC_FUZZ_MAX_FDS];
        if (!again) ipc_fuzz_fail("out of memory");
        if (cubuf_ipc_descriptor_serialize(d, again, &len, back, &n) != CUBUF_SUCCESS)
            ipc_fuzz_fail("serialize failed");
        if (memcmp(again, data, size) != 0) ipc_fuzz_fail("serialize does not give the input back");
        if (nfds && memcmp(back, fds, nfds * sizeof *fds) != 0) ipc_fuzz_fail("fds differ");
        free(again);
        cubuf_ipc_descriptor_destroy(d); /* closes our fds */
        for (size_t i = 0; i < nfds; i++)
            if (fcntl(fds[i], F_GETFD) != -1) ipc_fuzz_fail("destroy left an fd open");
        made = 1;
    } else {
        if (st != CUBUF_ERROR_INVALID_DESCRIPTOR && st != CUBUF_ERROR_OUT_OF_MEMORY)
            ipc_fuzz_fail("unexpected status");
        if (d) ipc_fuzz_fail("failure wrote the out-parameter");
        for (size_t i = 0; i < nfds; i++) {
            if (fcntl(fds[i], F_GETFD) == -1) ipc_fuzz_fail("a failed deserialize closed an fd");
            close(fds[i]);
        }
    }
    int probe_after = dup(devnull);
    close(probe_after);
    if (probe_after != probe_before) ipc_fuzz_fail("an fd leaked");
    return made;
}

#endif
