#include <cubuf.h>
#include <stdio.h>

int main(void)
{
    int count = 0;
    cubuf_status_t st = cubuf_device_count(&count);
    printf("cubuf %s: %s, %d device(s)\n", cubuf_version_string(), cubuf_status_name(st), count);
    return cubuf_version() == CUBUF_VERSION ? 0 : 1;
}
