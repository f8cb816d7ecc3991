/* Status names and strings, the thread-local detail, the warning handler. CPU only. */
#include <pthread.h>

#include "internal.h"
#include "test.h"

static const cubuf_status_t all[] = {
#define T_ALL_(name, value, text) CUBUF_##name,
    CUBUF_STATUS_MAP(T_ALL_)
#undef T_ALL_
};

static void *other_thread(void *arg)
{
    (void)arg;
    /* This thread has had no failure: its detail is empty. */
    return (void *)(uintptr_t)(cubuf_last_error()[0] == '\0');
}

static int warnings;
static cubuf_status_t warned_status;
static void on_warning(cubuf_status_t st, const char *msg, void *user)
{
    warnings++;
    warned_status = st;
    T_CHECK(user == &warnings);
    T_CHECK(strstr(msg, "planted") != NULL);
}

int main(void)
{
    size_t n = sizeof all / sizeof all[0];
    T_CHECK(n == 13);
    for (size_t i = 0; i < n; i++) {
        const char *name = cubuf_status_name(all[i]);
        const char *text = cubuf_status_string(all[i]);
        T_CHECK(strncmp(name, "CUBUF_", 6) == 0);
        T_CHECK(text && *text);
        T_CHECK((int)all[i] == (int)i); /* values are dense and never reused */
        for (size_t j = 0; j < i; j++) {
            T_CHECK(strcmp(name, cubuf_status_name(all[j])) != 0);
            T_CHECK(strcmp(text, cubuf_status_string(all[j])) != 0);
        }
    }
    T_CHECK(strcmp(cubuf_status_name(CUBUF_ERROR_CLOSED), "CUBUF_ERROR_CLOSED") == 0);
    T_CHECK(strcmp(cubuf_status_name((cubuf_status_t)999), "CUBUF_UNKNOWN_STATUS") == 0);
    T_CHECK(strcmp(cubuf_status_string((cubuf_status_t)999), "unknown status") == 0);

    /* Argument errors set a detail naming the function, on this thread only. */
    T_STATUS(cubuf_device_count(NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "cubuf_device_count") != NULL);
    T_CHECK(cubuf_last_cuda_result() == CUDA_SUCCESS);
    pthread_t t;
    void *clean = NULL;
    T_CHECK(pthread_create(&t, NULL, other_thread, NULL) == 0);
    pthread_join(t, &clean);
    T_CHECK(clean == (void *)1);

    /* The detail append keeps the message. */
    cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE, "first part");
    cubuf__detail_append("size %d", 42);
    T_CHECK(strcmp(cubuf_last_error(), "first part (size 42)") == 0);

    /* Warning handler: installed, called with the user pointer, then reset. */
    cubuf_set_warning_handler(on_warning, &warnings);
    cubuf__warn(CUBUF_ERROR_DRIVER, "planted %s", "warning");
    T_CHECK(warnings == 1 && warned_status == CUBUF_ERROR_DRIVER);
    cubuf_set_warning_handler(NULL, NULL);
    cubuf__warn(CUBUF_ERROR_DRIVER, "planted default warning (expected on stderr)");
    T_CHECK(warnings == 1);

    T_CHECK(cubuf_version() == CUBUF_VERSION);
    T_CHECK(strcmp(cubuf_version_string(), "0.1.0") == 0);
    /* Releasing NULL is a no-op. */
    cubuf_buffer_release(NULL);
    cubuf_resource_release(NULL);
    cubuf_context_destroy(NULL);
    return t_finish("test_status");
}
