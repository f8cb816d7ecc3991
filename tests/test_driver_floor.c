/* The driver floor: the oldest driver cubuf loads with is the highest
 * version among the required entry points (those src/ calls), reported by
 * cubuf_driver_min_version; a driver that old loads (optional entries newer
 * than it are NULL and report CUBUF_ERROR_NOT_SUPPORTED), an older one is
 * refused with CUBUF_ERROR_NO_DRIVER naming both versions. Runs without a
 * GPU: each case loads a stand-in libcuda (tests/fake_libcuda.c) reporting
 * a chosen version, in a child process (the driver loads once per process). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"

static const struct {
    const char *name;
    int version;
    bool required;
} entries[] = {
#define REQ_(name, v) {#name, v, true},
#define OPT_(name, v) {#name, v, false},
    CUBUF_DRIVER_ENTRIES(REQ_, OPT_)
#undef REQ_
#undef OPT_
};
#define N_ENTRIES (sizeof entries / sizeof entries[0])

/* The table's fields in entry order, to see which were resolved. */
static const void *resolved(size_t i)
{
    const void *const fields[] = {
#define FIELD_(name, v) (const void *)cubuf__drv.name,
        CUBUF_DRIVER_ENTRIES(FIELD_, FIELD_)
#undef FIELD_
    };
    return fields[i];
}

static void load_fake(int version)
{
    char v[32];
    snprintf(v, sizeof v, "%d", version);
    setenv("CUBUF_LIBCUDA", CUBUF_FAKE_LIBCUDA, 1);
    setenv("CUBUF_FAKE_DRIVER_VERSION", v, 1);
}

/* A driver of `version` >= the floor: loads, and resolves exactly the
 * entries it is new enough for. */
static void child_loads(int version)
{
    load_fake(version);
    int got = 0, count = -1;
    T_OK(cubuf_driver_version(&got));
    T_CHECK(got == version);
    T_OK(cubuf_device_count(&count));
    T_CHECK(count == 0);
    for (size_t i = 0; i < N_ENTRIES; i++) {
        bool want = entries[i].version <= version;
        if ((resolved(i) != NULL) != want) {
            fprintf(stderr, "driver %d: %s (%d, %s) is %s\n", version, entries[i].name,
                    entries[i].version, entries[i].required ? "required" : "optional",
                    resolved(i) ? "resolved" : "missing");
            t_failures++;
        }
    }
    /* An optional entry newer than the driver: NOT_SUPPORTED naming it. */
    if (version < 12080) {
        float ms = 0;
        T_STATUS(CU(cuEventElapsedTime, &ms, NULL, NULL), CUBUF_ERROR_NOT_SUPPORTED);
        T_CHECK(strstr(cubuf_last_error(), "cuEventElapsedTime") != NULL);
    }
    exit(t_finish("test_driver_floor (driver that loads)"));
}

/* A driver older than the floor: refused, the detail naming both versions. */
static void child_refused(int version, int floor)
{
    load_fake(version);
    int got = -1, count = -1;
    T_STATUS(cubuf_driver_version(&got), CUBUF_ERROR_NO_DRIVER);
    T_CHECK(got == -1);
    char want[64];
    snprintf(want, sizeof want, "version %d.%d (%d)", version / 1000, version % 1000 / 10, version);
    T_CHECK(strstr(cubuf_last_error(), want) != NULL);
    snprintf(want, sizeof want, "needs %d.%d (%d) or newer", floor / 1000, floor % 1000 / 10, floor);
    T_CHECK(strstr(cubuf_last_error(), want) != NULL);
    T_STATUS(cubuf_device_count(&count), CUBUF_ERROR_NO_DRIVER);
    T_STATUS(cubuf_stream_synchronize(NULL), CUBUF_ERROR_NO_DRIVER);
    T_CHECK(count == -1);
    printf("refused as it should be: %s\n", cubuf_last_error());
    exit(t_finish("test_driver_floor (driver too old)"));
}

static void run_child(void (*fn)(int, int), int version, int floor)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) fn(version, floor);
    int status = 0;
    T_CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "driver %d: the child failed (status 0x%x)\n", version, status);
        t_failures++;
    }
}

static void loads(int version, int floor)
{
    (void)floor;
    child_loads(version);
}

int main(void)
{
    /* The floor is the highest required version, whatever the table holds. */
    const int floor = cubuf_driver_min_version();
    int highest = 0;
    for (size_t i = 0; i < N_ENTRIES; i++)
        if (entries[i].required && entries[i].version > highest) highest = entries[i].version;
    T_CHECK(floor == highest);
    /* R535 / R550 cluster drivers (12.2 / 12.4) must load: a test or a
     * benchmark can never raise the floor (check_driver_entries.sh), and the
     * library itself needs nothing newer. */
    T_CHECK(floor <= 12040);
    printf("driver floor %d (CUDA %d.%d)\n", floor, floor / 1000, floor % 1000 / 10);

    run_child(child_refused, floor - 10, floor);
    run_child(loads, floor, floor);
    run_child(loads, 13000, floor);
    return t_finish("test_driver_floor");
}
