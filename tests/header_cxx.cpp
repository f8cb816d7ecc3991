// The public header from C++, linked against the shared library.
#include <cubuf.h>
#include <cstdio>

int main()
{
    cubuf_copy_options_t o = CUBUF_COPY_OPTIONS_INIT;
    (void)o;
    if (cubuf_version() != CUBUF_VERSION) return 1;
    std::printf("%s\n", cubuf_status_name(CUBUF_ERROR_CLOSED));
    return 0;
}
